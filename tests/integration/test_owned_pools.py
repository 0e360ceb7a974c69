"""Engine-owned pools over a real daemon and real sockets: store, match, load_into, attach,
in the engines' own layouts, through host and disk — and every bad input refused with
its code, nothing changed."""

import os
import signal
import time

import numpy as np
import pytest

from daemon_util import DaemonProcess, RawPeer
from hicache import protocol as p
from hicache.client import CacheClient, RemoteError
from hicache.engine.kv_pool import export_owned_pool
from hicache.errors import ErrorCode, LockUnderflow
from hicache.foreign import Allocation, ForeignLayout
from hicache.keys import key_self_test
from hicache.spec import KVSpec
from owned_util import BLOCK_BYTES, OWNED_SPEC, OwnedEngine, content, layer_major, split_layout
from tiers_util import SPEC, Engine

PS = OWNED_SPEC.page_size
NUM_BLOCKS = 40


def toks(start, pages, tail=0):
    return list(range(start, start + pages * PS + tail))


def sections(tmp_path, **disk):
    return dict(host={"bytes": 24 * OWNED_SPEC.host_page_bytes},
                disk={"path": str(tmp_path / "lmdb"), "capacity_bytes": 400 * OWNED_SPEC.host_page_bytes, **disk})


@pytest.fixture
def daemon(tmp_path):
    proc = DaemonProcess(tmp_path, **sections(tmp_path)).start()
    yield proc
    if proc.proc is not None:
        assert proc.stop() == 0, proc.log.read_text()


def admin(endpoint):
    return CacheClient(endpoint, heartbeat=False)


def stats_and_check(endpoint):
    client = admin(endpoint)
    try:
        client.check()
        return client.stats()
    finally:
        client.close()


def host_account(stats):
    (spec_stats,) = [v for k, v in stats["specs"].items() if k == OWNED_SPEC.fingerprint_hex]
    return spec_stats["host"]


def load(engine, scheduler, seq, blocks, first=0):
    """What a vLLM scheduler and worker do for a hit: match, lock, load_into, wait, unlock."""
    m = scheduler.match(seq)
    scheduler.lock(m.handle)
    try:
        done = scheduler.load_into(m.handle, blocks, first)
        for layer in range(OWNED_SPEC.num_layers):
            engine.client.wait_layer(done.wait, layer, timeout_s=30)
    finally:
        scheduler.unlock(m.handle)
    return m, done


def test_store_then_another_engine_loads_into_its_own_blocks_in_its_own_geometry(daemon):
    a = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="engine-a")
    b = OwnedEngine(daemon.endpoint, split_layout(NUM_BLOCKS), name="engine-b")
    scheduler = CacheClient(daemon.endpoint)
    try:
        seq = toks(100, 6, tail=5)
        a_blocks = [7, 3, 9, 11, 2, 30]
        a.compute(seq, a_blocks)
        stored = a.client.store(seq, a_blocks)
        assert (stored.num_copied, stored.num_cached) == (6, 6) and stored.handle is not None
        again = a.client.store(seq, a_blocks)  # nothing copied twice
        assert (again.num_copied, again.num_cached) == (0, 6)

        scheduler.attach("engine-b")
        m = scheduler.match(seq)
        assert (m.num_device_pages, m.num_host_pages, m.num_disk_pages) == (0, 6, 0)
        # The engine has pages 0-1 in its own prefix cache: load pages 2.. into new blocks.
        b_blocks = [21, 5, 38, 1]
        b.wipe(b_blocks)
        _, done = load(b, scheduler, seq, b_blocks, first=2)
        assert done.num_loaded_pages == 4 and len(done.wait) == 1
        b.check(seq, b_blocks, first=2)

        # A longer prompt sharing the prefix: only the new pages are copied.
        longer = seq[: 6 * PS] + toks(5000, 3)
        a.compute(longer, [12, 13, 14], first=6)
        grown = a.client.store(longer, a_blocks + [12, 13, 14])
        assert (grown.num_copied, grown.num_cached) == (3, 9)
        m = scheduler.match(longer)
        assert m.num_host_pages == 9
        b.wipe(range(1, NUM_BLOCKS))
        _, done = load(b, scheduler, longer, list(range(10, 19)))
        assert done.num_loaded_pages == 9
        b.check(longer, list(range(10, 19)))
        stats = stats_and_check(daemon.endpoint)
        assert host_account(stats)["cached_evictable"] == 9
    finally:
        scheduler.close()
        a.close()
        b.close()
    stats = stats_and_check(daemon.endpoint)
    assert stats["sessions"] == 0


def test_pages_come_back_from_disk_after_a_daemon_restart(tmp_path):
    daemon = DaemonProcess(tmp_path, **sections(tmp_path)).start()
    seq = toks(7, 5, tail=1)
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="w")
    try:
        engine.compute(seq, [4, 5, 6, 7, 8])
        assert engine.client.store(seq, [4, 5, 6, 7, 8]).num_cached == 5
        flusher = admin(daemon.endpoint)
        flusher.flush()
        flusher.close()
    finally:
        engine.close()
    assert daemon.stop() == 0
    daemon = DaemonProcess(tmp_path, **sections(tmp_path)).start()
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="w")
    scheduler = CacheClient(daemon.endpoint)
    try:
        scheduler.attach("w")
        m = scheduler.match(seq)
        assert (m.num_host_pages, m.num_disk_pages) == (0, 5)
        engine.wipe(range(1, NUM_BLOCKS))
        _, done = load(engine, scheduler, seq, [30, 31, 32, 33, 34])
        assert done.num_loaded_pages == 5
        engine.check(seq, [30, 31, 32, 33, 34])
        stats_and_check(daemon.endpoint)
    finally:
        scheduler.close()
        engine.close()
        assert daemon.stop() == 0


def test_a_load_into_past_the_engines_own_prefix_reads_the_pages_before_it_from_disk_too(daemon):
    """vLLM holds the first pages of a prompt itself and asks for the rest
    (``first`` > 0). When the whole path has left host memory for disk, the pages
    before ``first`` must come to host too: a page is kept on host only below a
    parent on host (before, only pages ``first ..`` were read, and the read was
    thrown away: nothing loaded of what the match promised)."""
    worker = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="d")
    scheduler = CacheClient(daemon.endpoint)
    try:
        scheduler.attach("d")
        seq = toks(800, 4)
        worker.compute(seq, [1, 2, 3, 4])
        assert worker.client.store(seq, [1, 2, 3, 4]).num_cached == 4
        flusher = admin(daemon.endpoint)
        flusher.flush()
        flusher.close()
        m = scheduler.match(seq)
        assert m.num_host_pages == 4
        other = toks(5000, 24)  # the host tier's 24 pages: the prompt's copies there go
        worker.compute(other, list(range(10, 34)))
        assert worker.client.store(other, list(range(10, 34))).num_cached == 24
        flusher = admin(daemon.endpoint)
        flusher.flush()  # (their write-backs done: pages being written are not evictable)
        flusher.close()
        assert host_account(stats_and_check(daemon.endpoint))["cached_evictable"] == 24
        worker.wipe([35, 36])
        done = scheduler.load_into(m.handle, [35, 36], 2, locked=False)
        assert done.num_loaded_pages == 2
        for layer in range(OWNED_SPEC.num_layers):
            worker.client.wait_layer(done.wait, layer, timeout_s=30)
        worker.check(seq, [35, 36], first=2)
        stats_and_check(daemon.endpoint)
    finally:
        scheduler.close()
        worker.close()


def test_an_attached_session_stores_from_the_pools_blocks(daemon):
    """A session attached to an engine-owned pool stores from that pool's blocks (the
    same engine's: a scheduler or a second client of the worker), as its owner does."""
    worker = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="st")
    other = CacheClient(daemon.endpoint)
    try:
        other.attach("st")
        seq = toks(300, 4, tail=2)
        blocks = [6, 2, 17, 9]
        worker.compute(seq, blocks)
        stored = other.store(seq, blocks)
        assert (stored.num_copied, stored.num_cached) == (4, 4)
        assert worker.client.store(seq, blocks).num_copied == 0  # the owner finds them cached
        m = worker.client.match(seq)
        assert m.num_host_pages == 4
        worker.wipe(range(1, NUM_BLOCKS))
        _, done = load(worker, other, seq, [30, 31, 32, 33])
        assert done.num_loaded_pages == 4
        worker.check(seq, [30, 31, 32, 33])
        stats_and_check(daemon.endpoint)
    finally:
        other.close()
        worker.close()


def test_owner_going_ends_its_attached_sessions_and_returns_their_locks(daemon):
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="gone")
    scheduler = CacheClient(daemon.endpoint, timeout_s=2.0, reconnect_interval_s=0.1)
    seq = toks(300, 4)
    engine.compute(seq, [1, 2, 3, 4])
    engine.client.store(seq, [1, 2, 3, 4])
    scheduler.attach("gone")
    m = scheduler.match(seq)
    scheduler.lock(m.handle)
    assert host_account(stats_and_check(daemon.endpoint))["cached_protected"] == 4
    engine.close()  # bye: the pool goes, and the scheduler's session with it
    stats = stats_and_check(daemon.endpoint)
    assert stats["sessions"] == 0
    assert host_account(stats)["cached_protected"] == 0 and host_account(stats)["cached_evictable"] == 4
    # The scheduler finds out on its next call: no pool of that name any more, a miss.
    assert scheduler.match(seq).handle is None
    scheduler.close()


def test_an_engine_that_says_bye_while_its_store_copies_leaves_its_memory_free_to_register_again(daemon):
    """Store and bye back to back on the engine's connection: the bye ends the session
    while the store's copy is still to be taken in, so its pool is retired in use. By
    the time the store is answered the pool is unmapped: the daemon maps none of its
    memory, and that memory registers again, under the same name."""
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="going", heartbeat=False)
    again = CacheClient(daemon.endpoint, heartbeat=False)
    try:
        seq = toks(500, 4)
        engine.compute(seq, [1, 2, 3, 4])
        client = engine.client
        sock = client._socket
        sock.send(p.encode(p.Store(id=1, session=client.session_id, tokens=np.asarray(seq, "<i4").tobytes(),
                                   pages=np.asarray([1, 2, 3, 4], "<i4").tobytes())))
        sock.send(p.encode(p.Bye(id=2, session=client.session_id)))
        replies = {}
        while len(replies) < 2:
            assert sock.poll(30_000), "the daemon stopped answering"
            reply = p.decode_reply(sock.recv())
            replies[reply.id] = reply
        assert isinstance(replies[1], p.StoreReply) and isinstance(replies[2], p.Ok), replies
        client._session = 0  # (said bye)
        assert daemon_mapped_bytes(daemon.proc.pid, "hicache-owned-0") is None
        stats_and_check(daemon.endpoint)
        again.register_owned(OWNED_SPEC, engine.exported.handle)
        assert again.match(seq).num_host_pages == replies[1].cached
        stats_and_check(daemon.endpoint)
    finally:
        again.close()
        engine.close()


def test_bad_input_is_refused_with_its_code_and_changes_nothing(daemon):
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="e")
    other = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="f")
    scheduler = CacheClient(daemon.endpoint)
    seq = toks(40, 4)
    try:
        engine.compute(seq, [1, 2, 3, 4])
        engine.client.store(seq, [1, 2, 3, 4])
        scheduler.attach("e")
        m = scheduler.match(seq)
        before = {}

        def refused(code, fn, *args):
            if not before:
                before.update(stats_and_check(daemon.endpoint)["specs"])
            with pytest.raises(RemoteError) as info:
                fn(*args)
            assert info.value.code == code, info.value
            assert stats_and_check(daemon.endpoint)["specs"] == before

        bad = ErrorCode.INVALID_ARGUMENT
        refused(bad, engine.client.store, toks(900, 2), [1, NUM_BLOCKS])  # past the last block
        refused(bad, engine.client.store, toks(900, 2), [0, 1])  # block 0: the null block
        refused(bad, engine.client.store, toks(900, 2), [5, 5])  # one block for two pages
        refused(bad, engine.client.store, toks(900, 2), [5])  # a page without its block
        refused(ErrorCode.LOCK_UNDERFLOW, lambda: scheduler._request(  # not locked
            p.LoadInto(id=0, session=0, node=m.handle.node, pages=np.array([1], np.int32).tobytes())))
        scheduler.lock(m.handle)
        before.clear()  # (the lock protects the path now)
        refused(bad, scheduler.load_into, m.handle, [1, 2, 3, 4, 5])  # more pages than the path
        refused(bad, scheduler.load_into, m.handle, [1, 2], 3)  # past its end
        refused(bad, scheduler.load_into, m.handle, [0])
        refused(bad, scheduler.load_into, m.handle, [NUM_BLOCKS])
        # Another session's node handle is unknown to this one.
        m_other = other.client.match(seq)
        with pytest.raises(RemoteError) as info:
            other.client._request(p.LoadInto(id=0, session=0, node=m.handle.node, pages=b""))
        assert info.value.code == ErrorCode.UNKNOWN_NODE
        assert m_other.num_host_pages == 4
        # hicache's own pool operations on an engine-owned pool, and the other way round.
        for call in (lambda: engine.client.alloc(1), lambda: engine.client.insert(seq, [1, 2, 3, 4]),
                     lambda: engine.client.release([1])):
            refused(bad, call)
        scheduler.unlock(m.handle)
        before.clear()
        with pytest.raises(LockUnderflow):
            scheduler.load_into(m.handle, [1])
        # Unlocked loads (one round trip, no lock held) are refused alike, leaving no lock.
        for args in (([1, 2, 3, 4, 5],), ([1, 2], 3), ([0],), ([NUM_BLOCKS],)):
            refused(bad, lambda a=args: scheduler.load_into(m.handle, *a, locked=False))
        with pytest.raises(RemoteError) as info:
            other.client._request(p.LoadInto(id=0, session=0, node=m.handle.node, pages=b"", unlocked=True))
        assert info.value.code == ErrorCode.UNKNOWN_NODE
        before.clear()  # (the native pool below adds its spec)
        native = Engine(16)
        client = CacheClient(daemon.endpoint)
        try:
            client.register(SPEC, [native.exported.handle])
            refused(bad, client.store, list(range(2 * SPEC.page_size)), [1, 2])
        finally:
            client.close()
            native.close()
        # Attaching to a pool nobody registered is refused; a second pool may not take a
        # registered name.
        stray = CacheClient(daemon.endpoint)
        with pytest.raises(RemoteError) as info:
            stray.attach("nobody")
        assert info.value.code == bad
        stray.close()
        with pytest.raises(RemoteError) as info:
            OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="e")
        assert info.value.code == bad
        assert stats_and_check(daemon.endpoint)["sessions"] == 3
    finally:
        scheduler.close()
        engine.close()
        other.close()


@pytest.mark.parametrize("daemon_can", [True, False], ids=["one-round-trip", "older-daemon"])
def test_an_unlocked_load_into_loads_and_leaves_no_lock_behind(daemon, daemon_can):
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="e")
    scheduler = CacheClient(daemon.endpoint)
    try:
        seq = toks(500, 5, tail=3)
        engine.compute(seq, [1, 2, 3, 4, 5])
        engine.client.store(seq, [1, 2, 3, 4, 5])
        scheduler.attach("e")
        scheduler._load_unlocked = daemon_can and scheduler._load_unlocked  # (what an older daemon's hello says)
        assert scheduler._load_unlocked == daemon_can
        engine.wipe(range(10, 15))
        m = scheduler.match(seq)
        done = scheduler.load_into(m.handle, [12, 13, 14], 2, locked=False)
        assert done.num_loaded_pages == 3 and not scheduler._locked
        for layer in range(OWNED_SPEC.num_layers):
            engine.client.wait_layer(done.wait, layer, timeout_s=30)
        engine.check(seq, [12, 13, 14], first=2)
        deadline = time.monotonic() + 30  # the load's own hold goes when its copies end
        while host_account(stats_and_check(daemon.endpoint))["cached_protected"]:
            assert time.monotonic() < deadline, "the load's hold was never released"
            time.sleep(0.05)
    finally:
        scheduler.close()
        engine.close()


def test_a_load_into_of_no_blocks_loads_nothing_wherever_first_falls(daemon):
    """An engine that has every page of a hit in its own prefix cache asks for none
    (``pages`` empty): the answer is nothing loaded and nothing held, whether ``first``
    falls on a node's end or inside a node (before, inside one: the node was cut at
    ``first``, then the request refused ``INVALID_ARGUMENT`` "cannot split ... after 0
    pages")."""
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="none")
    try:
        seq = toks(600, 4)
        engine.compute(seq, [1, 2, 3, 4])
        assert engine.client.store(seq, [1, 2, 3, 4]).num_cached == 4  # one node of 4 pages
        m = engine.client.match(seq)
        before = stats_and_check(daemon.endpoint)["specs"]
        for first in (0, 2, 4):
            for locked in (False, True):
                if locked:
                    engine.client.lock(m.handle)
                done = engine.client.load_into(m.handle, [], first, locked=locked)
                if locked:
                    engine.client.unlock(m.handle)
                assert (done.num_loaded_pages, done.wait) == (0, ()), (first, locked)
                assert stats_and_check(daemon.endpoint)["specs"] == before, (first, locked)
    finally:
        engine.close()


def test_a_layout_that_does_not_fit_is_refused_before_anything_is_mapped(daemon):
    peer = RawPeer(daemon.endpoint)
    spec = OWNED_SPEC
    bb = BLOCK_BYTES
    good = layer_major(8)
    exported = export_owned_pool(good)
    try:
        session = peer.hello()  # a refused registration leaves the session free to try again

        def register(layout_dict, nbytes=None, owned_spec=spec):
            token = peer.offer(exported.handle.buffers[0].fd)
            buffers = [{"kind": "memfd", "nbytes": nbytes or good.allocations[0].size, "token": token}]
            return peer.call(p.Register(
                id=0, session=session, spec=owned_spec.to_dict(), fingerprint=owned_spec.fingerprint,
                key_check=key_self_test(owned_spec.fingerprint, owned_spec.page_size), pools=[],
                owned={"layout": layout_dict, "buffers": buffers, "name": ""}))

        base = good.to_dict()
        cases = {
            "a block past its allocation": {**base, "num_blocks": 9},
            "blocks that overlap": {**base, "allocations": [{**base["allocations"][0], "block_stride": bb - 2}]},
            "layers that overlap": {**base, "allocations": [{**base["allocations"][0], "layer_stride": bb}]},
            "a block of the wrong size": {**base, "block_bytes": bb * 2},
            "a layer twice": {**base, "allocations": [{**base["allocations"][0], "layers": [0, 0, 2]}]},
            "a layer missing": {**base, "allocations": [{**base["allocations"][0], "layers": [0, 1]}]},
            "a layer that is not the spec's": {**base, "allocations": [{**base["allocations"][0],
                                                                       "layers": [0, 1, 7]}]},
            "a negative offset": {**base, "allocations": [{**base["allocations"][0], "offset": -bb}]},
        }
        for why, layout in cases.items():
            reply = register(layout)
            assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, (why, reply)
        reply = register(base, nbytes=good.allocations[0].size - 1)  # the buffer is not the allocation
        assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, reply
        plain = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, page_size=8, dtype="bfloat16")
        reply = register({**base, "spec": plain.to_dict()}, owned_spec=plain)  # no layout named
        assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, reply
        stats = stats_and_check(daemon.endpoint)
        assert stats["specs"] == {}  # nothing registered, no manager made
        reply = register(base)  # and the good one is accepted on the same connection
        assert isinstance(reply, p.RegisterReply), reply
    finally:
        peer.close()
        exported.close()


def test_pools_of_different_layouts_never_share_pages(daemon):
    other_spec = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, page_size=8, dtype="bfloat16",
                            model="test/owned", layout="test/other-packing")
    a = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="a")
    b = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS, spec=other_spec), name="b")
    try:
        seq = toks(1, 3)
        a.compute(seq, [1, 2, 3])
        assert a.client.store(seq, [1, 2, 3]).num_cached == 3
        assert b.client.match(seq).handle is None
        assert a.client.match(seq).num_host_pages == 3
    finally:
        a.close()
        b.close()


def test_a_store_larger_than_the_host_tier_keeps_what_fits(daemon):
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="big")
    try:
        seq = toks(10, 30)
        blocks = list(range(1, 31))
        engine.compute(seq, blocks)
        stored = engine.client.store(seq, blocks)
        assert 0 < stored.num_cached <= 24 and stored.num_copied == stored.num_cached
        m = engine.client.match(seq)
        assert m.num_host_pages + m.num_disk_pages == stored.num_cached
        stats_and_check(daemon.endpoint)
        assert content(seq, 0, 0).shape == (BLOCK_BYTES,)
    finally:
        engine.close()


def test_two_allocations_with_one_memfd_each_are_mapped_as_one_pool(daemon):
    layout = ForeignLayout(OWNED_SPEC, 6, BLOCK_BYTES, (
        Allocation(6 * BLOCK_BYTES, (0,), 0, BLOCK_BYTES),
        Allocation(6 * BLOCK_BYTES * 2, (1, 2), 6 * BLOCK_BYTES, BLOCK_BYTES),
    ))
    engine = OwnedEngine(daemon.endpoint, layout, name="two")
    try:
        seq = toks(3, 2)
        engine.compute(seq, [1, 2])
        assert engine.client.store(seq, [1, 2]).num_copied == 2
        engine.wipe([3, 4])
        m = engine.client.match(seq)
        engine.client.lock(m.handle)
        done = engine.client.load_into(m.handle, [4, 3])
        for layer in range(3):
            engine.client.wait_layer(done.wait, layer, timeout_s=30)
        engine.client.unlock(m.handle)
        engine.check(seq, [4, 3])
    finally:
        engine.close()


def test_a_daemon_restart_degrades_both_sides_and_revive_brings_the_pool_back(tmp_path):
    daemon = DaemonProcess(tmp_path, **sections(tmp_path)).start()
    worker = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="r", timeout_s=0.5,
                         reconnect_interval_s=0.1)
    scheduler = CacheClient(daemon.endpoint, timeout_s=0.5, reconnect_interval_s=0.1)
    seq = toks(77, 3)
    try:
        scheduler.attach("r")
        worker.compute(seq, [1, 2, 3])
        assert worker.client.store(seq, [1, 2, 3]).num_cached == 3
        admin_client = admin(daemon.endpoint)
        admin_client.flush()
        admin_client.close()
        assert daemon.stop() == 0
        # Down: every call answers without the daemon — nothing stored, nothing matched.
        assert worker.client.store(seq, [1, 2, 3]).num_cached == 0 and worker.client.degraded
        m = scheduler.match(seq)
        assert m.handle is None and scheduler.degraded
        assert scheduler.load_into(m.handle, [5]).num_loaded_pages == 0
        assert not worker.client.revive()
        daemon.start()
        # The scheduler cannot attach before the worker's pool is back...
        deadline = time.monotonic() + 20
        while not worker.client.revive():
            assert time.monotonic() < deadline, "the worker never registered again"
            time.sleep(0.1)
        while not scheduler.revive():
            assert time.monotonic() < deadline, "the scheduler never attached again"
            time.sleep(0.1)
        # ...and then hits what the first daemon wrote to disk.
        m = scheduler.match(seq)
        assert m.num_disk_pages == 3
        worker.wipe([7, 8, 9])
        _, done = load(worker, scheduler, seq, [7, 8, 9])
        assert done.num_loaded_pages == 3
        worker.check(seq, [7, 8, 9])
    finally:
        scheduler.close()
        worker.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0


def test_an_idle_worker_registers_again_after_a_daemon_restart_and_its_scheduler_attaches(tmp_path):
    """No request comes while the daemon restarts: neither side makes a call. Their
    heartbeats are answered ``UNKNOWN_SESSION`` by the new daemon; each must find out
    from that (before, the answers were dropped unread, and a worker idle since never
    registered again — its scheduler could not attach until a request came, and
    missed it)."""
    daemon = DaemonProcess(tmp_path, **sections(tmp_path)).start()
    worker = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="idle", timeout_s=0.5,
                         reconnect_interval_s=0.1)
    scheduler = CacheClient(daemon.endpoint, timeout_s=0.5, reconnect_interval_s=0.1)
    seq = toks(700, 2)
    try:
        scheduler.attach("idle")
        assert daemon.stop() == 0
        daemon.start()
        # What vLLM's connector does on both sides: revive a client that finds itself
        # degraded (its own calls do the same, but none comes here).
        deadline = time.monotonic() + 20
        while worker.client.epoch < 2 or scheduler.epoch < 2 or scheduler.degraded:
            assert time.monotonic() < deadline, (
                f"worker epoch {worker.client.epoch} (degraded: {worker.client.degraded}), "
                f"scheduler epoch {scheduler.epoch} (degraded: {scheduler.degraded})")
            for client in (worker.client, scheduler):
                if client.degraded:
                    client.revive()
            time.sleep(0.05)
        worker.compute(seq, [1, 2])
        assert worker.client.store(seq, [1, 2]).num_cached == 2
        assert scheduler.match(seq).num_host_pages == 2
        stats_and_check(daemon.endpoint)
    finally:
        scheduler.close()
        worker.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0


def test_a_load_ticket_from_before_a_daemon_restart_reads_only_what_its_own_daemon_did(tmp_path):
    """The scheduler hands the worker the tickets of its ``load_into``; the worker waits
    on them on its pool's ring — the new daemon's ring once it has registered again.
    A ticket of the daemon that stopped must not read as the new daemon's load that
    has its slot now: were it done there, the worker would read blocks nothing loaded
    into. It reads what its own daemon did, on the ring it was answered on (which the
    worker keeps mapped): that load landed before the daemon stopped (its stop drains
    the copies), so its blocks hold the KV."""
    daemon = DaemonProcess(tmp_path, **sections(tmp_path)).start()
    worker = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="t", timeout_s=0.5,
                         reconnect_interval_s=0.1)
    scheduler = CacheClient(daemon.endpoint, timeout_s=0.5, reconnect_interval_s=0.1)
    seq = toks(600, 2)
    try:
        scheduler.attach("t")
        worker.compute(seq, [1, 2])
        assert worker.client.store(seq, [1, 2]).num_cached == 2
        admin_client = admin(daemon.endpoint)
        admin_client.flush()
        admin_client.close()
        m = scheduler.match(seq)
        before = scheduler.load_into(m.handle, [5, 6], locked=False)  # the worker has not waited yet
        assert before.num_loaded_pages == 2
        assert not worker.client.waiter.writer_gone()
        assert daemon.stop() == 0
        assert worker.client.waiter.writer_gone()  # (nothing can stamp the ring any more)
        assert worker.client.store(seq, [1, 2]).num_cached == 0 and worker.client.degraded
        assert scheduler.match(seq).handle is None and scheduler.degraded
        daemon.start()
        deadline = time.monotonic() + 20
        while not worker.client.revive():
            assert time.monotonic() < deadline, "the worker never registered again"
            time.sleep(0.1)
        while not scheduler.revive():
            assert time.monotonic() < deadline, "the scheduler never attached again"
            time.sleep(0.1)
        m = scheduler.match(seq)
        after = scheduler.load_into(m.handle, [7, 8], locked=False)
        assert after.num_loaded_pages == 2
        for layer in range(OWNED_SPEC.num_layers):
            worker.client.wait_layer(after.wait, layer, timeout_s=30)
        worker.check(seq, [7, 8])
        assert not any(worker.client.waiter.holds(t) for t in before.wait)
        for layer in range(OWNED_SPEC.num_layers):
            worker.client.wait_layer(before.wait, layer, timeout_s=30)
        worker.check(seq, [5, 6])
    finally:
        scheduler.close()
        worker.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0


def _registered_again(daemon, worker, tokens):
    """The daemon stalls (stopped) past the worker's timeout: the worker's match of
    ``tokens`` gives up (degraded), and once the daemon answers again the worker
    registers its pool again — a new pool with a new counter ring. Returns the old ring."""
    old_ring = worker.client.waiter
    worker.client.timeout_s = 0.3  # (this call's only)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        assert worker.client.match(tokens).handle is None and worker.client.degraded
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    worker.client.timeout_s = 5.0
    assert worker.client.revive() and worker.client.waiter is not old_ring
    return old_ring


def test_a_load_answered_before_its_pool_was_registered_again_is_waited_on_its_own_ring(tmp_path):
    """The daemon stalls (stopped here) past the worker's timeout, so the worker
    registers its pool again once it answers — a new pool with a new counter ring —
    while a load the scheduler started into its blocks before may still be copying:
    the old pool retires only once its transfers end. Its tickets are waited on the
    ring they were answered on, which the daemon stamps as the copy goes on. Before,
    that ring was unmapped at the new registration and the tickets read as stale — a
    load the daemon may still be writing read as over (``wait_over``), and vLLM's
    connector reported its blocks at once, free for another request to take."""
    daemon = DaemonProcess(tmp_path, server={"lease_s": 60.0}, **sections(tmp_path)).start()
    worker = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="w", heartbeat=False)
    scheduler = CacheClient(daemon.endpoint, heartbeat=False)
    seq = toks(640, 2)
    try:
        scheduler.attach("w")
        worker.compute(seq, [1, 2])
        assert worker.client.store(seq, [1, 2]).num_cached == 2
        worker.wipe([5, 6])
        before = scheduler.load_into(scheduler.match(seq).handle, [5, 6], locked=False)
        assert before.num_loaded_pages == 2
        old_session = worker.client.session_id
        old_ring = _registered_again(daemon, worker, seq)
        assert worker.client.session_id != old_session
        assert not any(worker.client.waiter.holds(t) for t in before.wait)
        assert worker.client.wait_over(before.wait, timeout_s=30)
        for layer in range(OWNED_SPEC.num_layers):
            worker.client.wait_layer(before.wait, layer, timeout_s=30)
        worker.check(seq, [5, 6])
        # The retired pool goes once no copy for it is left, and its ring with it: the
        # daemon's lock on the old ring is let go, not the one on the new.
        deadline = time.monotonic() + 30
        while not old_ring.writer_gone():
            assert time.monotonic() < deadline, "the daemon never let go of the retired pool's ring"
            check_admin = admin(daemon.endpoint)  # (a request: the loop's catch-up reaps)
            check_admin.check()
            check_admin.close()
        assert not worker.client.waiter.writer_gone()
        # The scheduler's session was attached to the retired pool: its next call
        # attaches to the new one, whose loads are waited on the new ring.
        hit = scheduler.match(seq)
        assert scheduler.epoch == 2 and hit.num_host_pages == 2
        worker.wipe([7, 8])
        after = scheduler.load_into(hit.handle, [7, 8], locked=False)
        assert after.num_loaded_pages == 2 and all(worker.client.waiter.holds(t) for t in after.wait)
        assert worker.client.wait_over(after.wait, timeout_s=30)
        worker.check(seq, [7, 8])
        stats_and_check(daemon.endpoint)
    finally:
        scheduler.close()
        worker.close()
        assert daemon.stop() == 0


def _two_loads_on_one_slot(worker, scheduler, flusher, first, second):
    """``first`` and ``second`` stored by ``worker`` (blocks 1-2, 3-4), then loaded by
    ``scheduler`` into blocks 10-11 and 12-13 one after the other on a pool of one
    counter slot: the second load takes the first's slot once that has landed. Both
    loads over when it returns; their answers returned."""
    scheduler.attach("w")
    worker.compute(first, [1, 2])
    worker.compute(second, [3, 4])
    assert worker.client.store(first, [1, 2]).num_cached == 2
    assert worker.client.store(second, [3, 4]).num_cached == 2
    worker.wipe([10, 11, 12, 13])
    early = scheduler.load_into(scheduler.match(first).handle, [10, 11], locked=False)
    flusher.flush()  # (its copies are over: its slot is free again)
    late = scheduler.load_into(scheduler.match(second).handle, [12, 13], locked=False)
    assert early.num_loaded_pages == late.num_loaded_pages == 2
    assert [t.slot for t in early.wait] == [t.slot for t in late.wait]
    flusher.flush()
    return early, late


def test_a_load_whose_counter_slot_went_to_a_later_load_before_the_worker_looked_reads_as_landed(tmp_path):
    """vLLM's scheduler answers a step's loads before its worker waits on any of them:
    with more loads than the pool has counter slots (one here), a load's slot has gone
    to a later load by the time the worker looks. The load landed, and reads so —
    before, its ticket read as stale and the connector reported its blocks as a failed
    load, recomputed for nothing."""
    daemon = DaemonProcess(tmp_path, tiers={"counter_slots": 1}, **sections(tmp_path)).start()
    worker = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="w")
    scheduler = CacheClient(daemon.endpoint)
    flusher = admin(daemon.endpoint)
    first, second = toks(100, 2), toks(300, 2)
    try:
        early, late = _two_loads_on_one_slot(worker, scheduler, flusher, first, second)
        for layer in range(OWNED_SPEC.num_layers):
            worker.client.wait_layer(early.wait + late.wait, layer, timeout_s=30)
        assert worker.client.wait_over(early.wait, timeout_s=30)
        worker.check(first, [10, 11])
        worker.check(second, [12, 13])
    finally:
        flusher.close()
        scheduler.close()
        worker.close()
        assert daemon.stop() == 0


def test_a_landed_load_whose_slot_moved_on_reads_as_landed_from_a_retired_ring(tmp_path):
    """A pool of one counter slot: a load lands and a later one takes its slot, then the
    worker registers the pool again (the daemon stalled past its timeout). The first
    load's ticket is known to the retired ring alone, by its log of ended loads: it
    reads as landed there — not as the new ring's stale ticket, a failed load that the
    connector would make vLLM recompute."""
    daemon = DaemonProcess(tmp_path, server={"lease_s": 60.0}, tiers={"counter_slots": 1},
                           **sections(tmp_path)).start()
    worker = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="w", heartbeat=False)
    scheduler = CacheClient(daemon.endpoint, heartbeat=False)
    flusher = admin(daemon.endpoint)
    first, second = toks(100, 2), toks(300, 2)
    try:
        early, _ = _two_loads_on_one_slot(worker, scheduler, flusher, first, second)
        assert not any(worker.client.waiter.holds(t) for t in early.wait)
        _registered_again(daemon, worker, first)
        assert not any(worker.client.waiter.knows(t) for t in early.wait)
        for layer in range(OWNED_SPEC.num_layers):
            worker.client.wait_layer(early.wait, layer, timeout_s=30)
        assert worker.client.wait_over(early.wait, timeout_s=30)
        worker.check(first, [10, 11])
    finally:
        flusher.close()
        scheduler.close()
        worker.close()
        assert daemon.stop() == 0


def test_a_store_that_arrives_after_its_deadline_is_refused_and_caches_nothing(daemon, monkeypatch):
    """A store carries when its engine stops waiting (the host's CLOCK_MONOTONIC): one
    the daemon gets after that is refused (``TIMEOUT``), nothing copied."""
    from hicache import protocol

    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="late")
    scheduler = CacheClient(daemon.endpoint)
    try:
        seq = toks(300, 3)
        engine.compute(seq, [1, 2, 3])
        real = protocol.monotonic_ns
        monkeypatch.setattr(protocol, "monotonic_ns", lambda: real() - 60 * 10**9)  # sent a minute ago
        with pytest.raises(RemoteError) as refused:
            engine.client.store(seq, [1, 2, 3])
        assert refused.value.code == ErrorCode.TIMEOUT
        monkeypatch.setattr(protocol, "monotonic_ns", real)
        scheduler.attach("late")
        assert scheduler.match(seq).handle is None
        stats = stats_and_check(daemon.endpoint)
        assert host_account(stats)["cached_evictable"] == 0 and host_account(stats)["staging"] == 0
        assert engine.client.store(seq, [1, 2, 3]).num_cached == 3  # in time: stored
    finally:
        scheduler.close()
        engine.close()


def test_a_load_into_says_when_its_copies_end_and_one_past_that_on_arrival_copies_nothing(daemon):
    """A load_into carries when its engine stops waiting for the layers
    (``copy_deadline_ns``): the answer says so (``copies_end_ns``, after the answer's own
    deadline), no layer starts copying after it, and one the daemon gets after it is
    refused (``TIMEOUT``) with nothing written and nothing held. ``wait_over`` tells the
    engine when a load has ended."""
    from hicache import protocol

    a = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="copies-a")
    b = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="copies-b", load_timeout_s=2.0)
    scheduler = CacheClient(daemon.endpoint, load_timeout_s=2.0)
    try:
        seq = toks(700, 3)
        a.compute(seq, [1, 2, 3])
        a.client.store(seq, [1, 2, 3])
        scheduler.attach("copies-b")
        b.wipe([4, 5, 6])
        m = scheduler.match(seq)
        scheduler.lock(m.handle)
        now = protocol.monotonic_ns()
        with pytest.raises(RemoteError) as refused:
            scheduler._request(protocol.LoadInto(id=0, session=0, node=m.handle.node, pages=np.asarray(
                [4, 5, 6], np.int32).tobytes(), deadline_ns=now + 60 * 10**9, copy_deadline_ns=now - 1))
        assert refused.value.code == ErrorCode.TIMEOUT
        assert all(not b.block(layer, block).any() for layer in range(OWNED_SPEC.num_layers) for block in (4, 5, 6))
        stats_and_check(daemon.endpoint)
        sent = protocol.monotonic_ns()
        done = scheduler.load_into(m.handle, [4, 5, 6])
        assert done.num_loaded_pages == 3
        assert sent + 2 * 2 * 10**9 <= done.copies_end_ns <= protocol.monotonic_ns() + 2 * 2 * 10**9
        assert b.client.wait_over(done.wait, timeout_s=30)
        b.check(seq, [4, 5, 6])
        scheduler.unlock(m.handle)
        stats_and_check(daemon.endpoint)
    finally:
        scheduler.close()
        b.close()
        a.close()


def test_a_refused_store_leaves_nothing_of_its_namespace_behind(daemon, monkeypatch):
    """A refused request changes nothing: a store refused for its blocks, or for a
    deadline passed before it arrived, or one of no whole page, records no namespace
    for good — no line in the tenant log, no tenant in the tree (before, each noted its
    namespace first: a client naming ever new extra keys grew both with every refusal)."""
    from hicache import protocol

    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="ns")
    log = daemon.directory / "lmdb" / "tenants"

    def noted():
        return log.read_text().splitlines() if log.exists() else []

    try:
        seq = toks(900, 2)
        engine.compute(seq, [1, 2])
        assert engine.client.store(seq, [1, 2], "kept").num_cached == 2
        before = noted()
        assert len(before) == 1
        for key, blocks in (("null", [0, 1]), ("twice", [5, 5]), ("past", [1, NUM_BLOCKS]), ("short", [5])):
            with pytest.raises(RemoteError) as info:
                engine.client.store(seq, blocks, key)
            assert info.value.code == ErrorCode.INVALID_ARGUMENT, key
        assert engine.client.store(seq[: PS - 1], [], "empty").num_cached == 0
        real = protocol.monotonic_ns
        monkeypatch.setattr(protocol, "monotonic_ns", lambda: real() - 60 * 10**9)
        with pytest.raises(RemoteError) as info:
            engine.client.store(seq, [1, 2], "late")
        assert info.value.code == ErrorCode.TIMEOUT
        monkeypatch.setattr(protocol, "monotonic_ns", real)
        stats_and_check(daemon.endpoint)
        assert noted() == before
    finally:
        engine.close()


def test_a_store_its_engine_gave_up_on_never_copies_the_blocks_reused_since(tmp_path):
    """The engine's store times out (the daemon is stopped here: a stall, swap), the
    engine reuses the blocks for another request; the daemon, resumed, executes the
    store it received: it must cache none of it (before, it copied the new contents
    under the old tokens)."""
    import os
    import signal

    daemon = DaemonProcess(tmp_path, server={"lease_s": 30.0}, **sections(tmp_path)).start()
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="slow", timeout_s=0.3)
    scheduler = CacheClient(daemon.endpoint)
    status = admin(daemon.endpoint)
    try:
        scheduler.attach("slow")
        seq = toks(400, 3)
        engine.compute(seq, [1, 2, 3])
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            assert engine.client.store(seq, [1, 2, 3]).num_cached == 0  # given up: degraded
            engine.compute(toks(9000, 3), [1, 2, 3])  # the blocks' next owner
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not any(key.startswith("store/") for key in status.stats()["requests"]):
            assert time.monotonic() < deadline, "the daemon never answered the store"
            time.sleep(0.05)
        assert status.stats()["requests"].get("store/TIMEOUT") == 1
        assert scheduler.match(seq).handle is None
    finally:
        status.close()
        scheduler.close()
        engine.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0


def test_a_load_into_its_engine_gave_up_on_never_writes_the_blocks_reused_since(tmp_path):
    """The load_into times out (the daemon is stopped: a stall), the client answers
    "nothing loaded" and the engine computes another request into those blocks; the
    daemon, resumed, must not copy the cached pages over them (before, it did, once
    the engine had stopped waiting for them)."""
    import os
    import signal

    daemon = DaemonProcess(tmp_path, server={"lease_s": 30.0}, **sections(tmp_path)).start()
    engine = OwnedEngine(daemon.endpoint, layer_major(NUM_BLOCKS), name="slow-load", load_timeout_s=0.3)
    status = admin(daemon.endpoint)
    try:
        seq, other = toks(400, 3), toks(9000, 3)
        engine.compute(seq, [1, 2, 3])
        engine.client.store(seq, [1, 2, 3])
        m = engine.client.match(seq)
        engine.client.lock(m.handle)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            assert engine.client.load_into(m.handle, [10, 11, 12]).num_loaded_pages == 0  # given up: degraded
            engine.compute(other, [10, 11, 12])  # the blocks' next owner
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not any(key.startswith("load_into/") for key in status.stats()["requests"]):
            assert time.monotonic() < deadline, "the daemon never answered the load_into"
            time.sleep(0.05)
        status.flush()  # (every copy landed)
        engine.check(other, [10, 11, 12])
        assert status.stats()["requests"].get("load_into/TIMEOUT") == 1
        status.check()
    finally:
        status.close()
        engine.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0


def daemon_mapped_bytes(pid: int, memfd_name: str) -> int | None:
    """The daemon's Rss of its mapping of the memfd ``memfd_name`` (``None``: not mapped)."""
    with open(f"/proc/{pid}/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) > 5 and fields[5] == f"/memfd:{memfd_name}"
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    return None


def test_the_daemon_maps_in_the_blocks_an_engine_holds_as_it_registers_and_no_hole(daemon):
    """So that the first loads into an engine's blocks take no page fault in the daemon
    (each cost a fault per 4 KiB page before) — and a sparse pool is not filled in."""
    layout = layer_major(NUM_BLOCKS)
    exported = export_owned_pool(layout)
    client = CacheClient(daemon.endpoint)
    try:
        size = layout.allocations[0].size
        written = size // 2 // 4096 * 4096
        exported.tensors[0][:written] = 1  # the engine's KV so far; the rest never touched
        client.register_owned(OWNED_SPEC, exported.handle)
        pid = daemon.proc.pid
        deadline = time.monotonic() + 60
        while daemon_mapped_bytes(pid, "hicache-owned-0") != written:
            assert (daemon_mapped_bytes(pid, "hicache-owned-0") or 0) < written, "the daemon mapped a hole"
            assert time.monotonic() < deadline, f"mapped {daemon_mapped_bytes(pid, 'hicache-owned-0')} of {written}"
            time.sleep(0.05)
        assert os.fstat(exported.buffers[0].fd).st_blocks * 512 == written  # nothing allocated by the daemon
    finally:
        client.close()
        exported.close()
