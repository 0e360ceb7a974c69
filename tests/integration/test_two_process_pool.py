"""Two processes: an engine that owns a CPU shared-memory KV pool, and the daemon side.

The engine process exports its pool, fills it and offers it on a descriptor socket;
this process (playing the daemon) maps the pool through hicache.pools, backs pages up to a host pool, and loads them back
into other pages layer by layer, stamping the layer counters. The engine waits on each
layer with ``wait_layer`` — always *before* the daemon copies it (the copier is the slow
side) — and checks the bytes of that layer, and that the next layer is not yet there.
Nothing is ordered by sleeping: each step waits for the other side's message.
"""

import os
import traceback

import numpy as np
import torch

from daemon_util import engine_processes
from hicache import fdpass
from hicache.counters import CountersHandle, LayerCounters, LayerWaiter, Ticket
from hicache.engine.kv_pool import export_kv_pool
from hicache.fdpass import FdExchange
from hicache.pools import DevicePool, HostPool, PoolHandle
from hicache.shm import SharedBuffer
from hicache.spec import KVSpec, MHALayer, MLALayer
from hicache.transfer import PageMover

SPEC = KVSpec(
    page_size=16,
    layers=(MHALayer(num_kv_heads=4, head_dim=32), MLALayer(kv_lora_rank=48, qk_rope_head_dim=16, dtype="float16"),
            MHALayer(num_kv_heads=2, head_dim=64, dtype="float8_e4m3fn"), MHALayer(num_kv_heads=4, head_dim=32)),
    model="two-process-test",
)
NUM_PAGES = 12
SRC_PAGES = [7, 2, 11, 4]
HOST_PAGES = [3, 0, 5, 1]
DST_PAGES = [9, 1, 5, 12]
TIMEOUT_S = 60.0


def page_bytes(pool: DevicePool, layer: int, page: int) -> bytes:
    return b"".join(
        pool.buffer[r.offset + page * r.unit_bytes : r.offset + (page + 1) * r.unit_bytes].numpy().tobytes()
        for r in pool.layout.token_regions if r.layer == layer
    )


def engine_main(conn, fd_socket) -> None:
    try:
        exported = export_kv_pool(SPEC, NUM_PAGES)
        pool = exported.pool
        rng = np.random.default_rng(1234)
        pool.buffer.copy_(torch.from_numpy(rng.integers(0, 256, pool.buffer.numel(), dtype=np.uint8)))
        before = pool.buffer.clone()
        token = fdpass.offer(fd_socket, exported.handle.fd)
        conn.send(("pool", exported.handle.to_dict() | {"token": token}))
        kind, counters_handle, ticket = conn.recv()
        assert kind == "load"
        counters_handle = CountersHandle.from_dict(counters_handle)
        waiter = LayerWaiter(counters_handle, fdpass.fetch(fd_socket, counters_handle.token))
        ticket = Ticket(*ticket)
        originals = {(layer, page): page_bytes(pool, layer, page)
                     for layer in range(SPEC.num_layers) for page in SRC_PAGES}
        for layer in range(SPEC.num_layers):
            assert not waiter.is_done(ticket, layer), f"layer {layer} done before the copier ran"
            conn.send(("waiting", layer))
            waiter.wait_layer(ticket, layer, timeout_s=TIMEOUT_S)
            for src, dst in zip(SRC_PAGES, DST_PAGES):
                assert page_bytes(pool, layer, dst) == originals[(layer, src)], (layer, src, dst)
            if layer + 1 < SPEC.num_layers:
                assert not waiter.is_done(ticket, layer + 1), "the next layer landed too early"
                for src, dst in zip(SRC_PAGES, DST_PAGES):
                    assert page_bytes(pool, layer + 1, dst) != originals[(layer + 1, src)]
            conn.send(("verified", layer))
        # Nothing else of the pool changed.
        for region in pool.layout.token_regions:
            for page in range(NUM_PAGES + 1):
                if page in DST_PAGES:
                    continue
                lo = region.offset + page * region.unit_bytes
                assert torch.equal(pool.buffer[lo : lo + region.unit_bytes], before[lo : lo + region.unit_bytes])
        waiter.close()
        conn.send(("done", None))
        assert conn.recv() == "close"
        exported.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def expect(conn, kind):
    if not conn.poll(TIMEOUT_S):
        raise AssertionError(f"engine sent nothing while we waited for {kind!r}")
    got, value = conn.recv()
    if got == "error":
        raise AssertionError(f"engine process failed:\n{value}")
    assert got == kind, (got, value)
    return value


def test_engine_and_daemon_share_a_pool_layer_by_layer(tmp_path):
    """The pool and the ring travel as descriptors on a real descriptor socket."""
    exchange = FdExchange(tmp_path / "fds")
    ctx = engine_processes()
    parent, child = ctx.Pipe()
    engine = ctx.Process(target=engine_main, args=(child, str(exchange.path)))
    engine.start()
    try:
        handle = PoolHandle.from_dict(expect(parent, "pool"))
        offer = exchange.take(handle.token)
        assert offer.pid == engine.pid and offer.uid == os.getuid()
        pool = DevicePool.attach(handle, expected=SPEC,
                                 segment=lambda h: SharedBuffer.attach(offer.fd, h.nbytes, uid=offer.uid))
        host = HostPool(SPEC, 6, pinned=False)
        mover = PageMover(pool, host)
        mover.backup(SRC_PAGES, HOST_PAGES)
        counters = LayerCounters(num_slots=4, num_layers=SPEC.num_layers)
        ticket = counters.begin()
        token = exchange.publish(counters.reader_fd(), uid=os.getuid())
        parent.send(("load", counters.handle(token).to_dict(), tuple(ticket)))
        for layer in range(SPEC.num_layers):
            assert expect(parent, "waiting") == layer
            mover.load_layer(HOST_PAGES, DST_PAGES, layer)
            counters.complete_layer(ticket, layer)
            assert expect(parent, "verified") == layer
        expect(parent, "done")
        counters.finish(ticket)
        parent.send("close")
        engine.join(TIMEOUT_S)
        assert engine.exitcode == 0
        pool.close()
        host.close()
        counters.close()
    finally:
        exchange.close()
        if engine.is_alive():
            engine.kill()
