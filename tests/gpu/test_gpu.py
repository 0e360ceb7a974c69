"""Checks that need a CUDA device (``pytest -m gpu``; skipped elsewhere).

scripts/gpu_check.sh runs these and the CUDA page-copy benchmark on a GPU machine:
CUDA IPC pool export / import between two processes (and a description claiming more
than its allocation refused once opened), the pinned host pool, every Triton
kernel compiled for real against its torch reference, interprocess layer events.
"""

import multiprocessing
import multiprocessing.reduction
import os
import traceback

import pytest
import torch

pytestmark = pytest.mark.gpu

from daemon_util import DaemonProcess  # noqa: E402  (tests/: on the path by its conftest)
from hicache.client import CacheClient  # noqa: E402
from hicache.counters import CountersHandle, LayerCounters, LayerWaiter, Ticket  # noqa: E402
from hicache.engine.kv_pool import export_kv_pool, export_owned_pool  # noqa: E402
from hicache.foreign import OwnedPoolHandle  # noqa: E402
from hicache.integrations.vllm_kv import layout_of, share_kv_caches  # noqa: E402
from hicache.kernels.kv_indices import build_kv_indices, build_kv_page_indices  # noqa: E402
from hicache.kernels.page_copy import copy_pages_reference, copy_pages_triton  # noqa: E402
from hicache.kernels.slot_alloc import alloc_decode, alloc_extend  # noqa: E402
from hicache.pools import DeviceLayout, DevicePool, HostPool, PoolHandle, page_segments  # noqa: E402
from hicache.spec import KVSpec  # noqa: E402
from hicache.transfer import PageMover  # noqa: E402
from owned_util import OWNED_SPEC, layer_major, vllm_kv_caches  # noqa: E402

SPEC = KVSpec.mha(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, model="gpu-check")
TIMEOUT_S = 120


def _page_bytes(pool, layer: int, name: str, page: int) -> torch.Tensor:
    size = SPEC.page_size
    return pool.buffer_of(layer, name)[page * size : (page + 1) * size].contiguous().view(torch.uint8)


def _engine(conn) -> None:
    """Child process: export a CUDA pool, fill it, and answer the parent's checks."""
    try:
        exported = export_kv_pool(SPEC, 32, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(7)
        exported.pool.buffer.copy_(torch.randint(0, 256, (exported.pool.buffer.numel(),), generator=gen,
                                                 device="cuda", dtype=torch.int32).to(torch.uint8))
        torch.cuda.synchronize()
        conn.send(("pool", exported.handle.to_dict(), exported.pool.buffer.sum(dtype=torch.int64).item()))
        kind, counters = conn.recv()
        assert kind == "events"
        waiter = LayerWaiter(CountersHandle.from_dict(counters), multiprocessing.reduction.recv_handle(conn))
        conn.send(("ready", None))
        kind, ticket, src, dst = conn.recv()
        ticket = Ticket(*ticket)
        stream = torch.cuda.Stream()
        for layer in range(SPEC.num_layers):
            waiter.wait_layer(ticket, layer, stream=stream)
        stream.synchronize()
        # Compared as bytes: the pool's float16 views of random bytes hold NaNs, which
        # equal nothing (compared as floats, identical pages read as different).
        wrong = [
            (layer, name, s, d) for layer in range(SPEC.num_layers) for name in ("k", "v") for s, d in zip(src, dst)
            if not torch.equal(_page_bytes(exported.pool, layer, name, d), _page_bytes(exported.pool, layer, name, s))
        ]
        conn.send(("loaded", wrong))
        assert conn.recv() == "close"
        waiter.close()
        exported.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _expect(conn, kind):
    assert conn.poll(TIMEOUT_S), f"no {kind!r} from the engine process"
    got, *values = conn.recv()
    if got == "error":
        raise AssertionError(values[0])
    assert got == kind
    return values


def test_cuda_ipc_pool_pinned_host_and_layer_events_across_processes():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    engine = ctx.Process(target=_engine, args=(child,))
    engine.start()
    try:
        handle, checksum = _expect(parent, "pool")
        pool = DevicePool.attach(PoolHandle.from_dict(handle), expected=SPEC)
        assert pool.device.type == "cuda"
        assert pool.buffer.sum(dtype=torch.int64).item() == checksum, "the daemon sees other bytes"
        host = HostPool(SPEC, 16, pinned=True)
        assert host.buffer.is_pinned()
        mover = PageMover(pool, host)
        src, hosts, dst = [3, 9, 17, 30], [5, 0, 11, 2], [1, 2, 20, 31]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            mover.backup(src, hosts)
        stream.synchronize()
        for s, h in zip(src, hosts):
            for region in pool.layout.token_regions:
                a = region.offset + s * region.unit_bytes
                seg = [x for x in SPEC.host_page_layout() if (x.layer, x.component) == (region.layer, region.component)]
                b = h * SPEC.host_page_bytes + seg[0].offset
                assert torch.equal(pool.buffer[a : a + region.unit_bytes].cpu(), host.pages[b : b + region.unit_bytes])
        counters = LayerCounters(num_slots=2, num_layers=SPEC.num_layers, cuda_device=pool.device.index or 0)
        parent.send(("events", counters.handle().to_dict()))
        ring_fd = counters.reader_fd()
        multiprocessing.reduction.send_handle(parent, ring_fd, engine.pid)
        os.close(ring_fd)
        _expect(parent, "ready")
        ticket = counters.begin()
        with torch.cuda.stream(stream):
            # Enqueue every layer's copy and event record before telling the engine.
            mover.load(hosts, dst, on_layer=lambda layer: (counters.events.record(ticket, layer, stream),
                                                           counters.complete_layer(ticket, layer)))
        parent.send(("load", tuple(ticket), src, dst))
        (wrong,) = _expect(parent, "loaded")
        assert not wrong, f"the engine saw other bytes after waiting on the layer events: (layer, k/v, src, dst) {wrong}"
        stream.synchronize()
        counters.finish(ticket)
        parent.send("close")
        engine.join(TIMEOUT_S)
        assert engine.exitcode == 0
        host.close()
        assert not host.pinned or host._registered == []
        counters.close()
        pool.close()
    finally:
        if engine.is_alive():
            engine.kill()


def _exporter(conn) -> None:
    """Child process: one CUDA byte tensor exported, kept alive until the parent is done."""
    try:
        from hicache.cuda_ipc import export_tensor

        tensor = torch.arange(1 << 20, device="cuda").to(torch.uint8)
        torch.cuda.synchronize()
        conn.send(("exported", export_tensor(tensor), tensor.sum(dtype=torch.int64).item()))
        assert conn.recv() == "close"
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def test_a_cuda_ipc_storage_past_its_allocation_is_refused_once_opened():
    """What only the driver knows, checked right after opening: the allocation's real
    extent (cuMemGetAddressRange). Descriptions that pass every check before opening
    but put the storage past the end of a 1 MiB tensor's allocation (a larger
    storage_size_bytes, a larger storage_offset_bytes) are refused; the engine's own
    description maps the engine's bytes."""
    from hicache.cuda_ipc import allocation_range, open_tensor
    from hicache.errors import InvalidArgument

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    engine = ctx.Process(target=_exporter, args=(child,))
    engine.start()
    try:
        description, checksum = _expect(parent, "exported")
        nbytes, past = 1 << 20, 1 << 34  # (torch's allocation for 1 MiB is a few MiB at most)
        for bad in (description | {"size": [past], "storage_size_bytes": description["offset"] + past},
                    description | {"storage_offset_bytes": description["storage_offset_bytes"] + past}):
            with pytest.raises(InvalidArgument, match="outside the .*allocation"):
                open_tensor(bad, nbytes, uid=os.getuid())
        tensor = open_tensor(description, nbytes, uid=os.getuid())
        assert tensor.sum(dtype=torch.int64).item() == checksum
        storage = tensor.untyped_storage()
        start, size = allocation_range(storage.data_ptr(), tensor.device.index)
        assert start <= storage.data_ptr() and storage.data_ptr() + storage.nbytes() <= start + size
        del tensor, storage
        parent.send("close")
        engine.join(TIMEOUT_S)
        assert engine.exitcode == 0
    finally:
        if engine.is_alive():
            engine.kill()


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_copy_kernel_compiled(page_size):
    spec = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=8, page_size=page_size)
    layout = DeviceLayout.build(spec, num_pages=64)
    segments = page_segments(layout)
    src = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, device="cuda")
    src_pages = torch.tensor([5, 1, 63, 5, 20], device="cuda")
    dst_pages = torch.tensor([0, 9, 3, 4, 8], device="cuda")
    out = {}
    for name, kernel in (("triton", copy_pages_triton), ("reference", copy_pages_reference)):
        dst = torch.full((10 * spec.host_page_bytes,), 0xA5, dtype=torch.uint8, device="cuda")
        kernel(src, dst, src_pages, dst_pages, segments, max_programs=4)
        out[name] = dst
    assert torch.equal(out["triton"], out["reference"])
    # Straight into pinned host memory through its device-mapped pointer.
    host = HostPool(spec, 10, pinned=True)
    host.pages.fill_(0xA5)
    copy_pages_triton(src, host.pages, src_pages, dst_pages, segments)
    torch.cuda.synchronize()
    assert torch.equal(host.pages, out["reference"].cpu())
    host.close()


def test_slot_and_index_kernels_compiled():
    ps = 16
    prefix = torch.tensor([0, 5, 16, 33], device="cuda")
    seq = torch.tensor([40, 5, 70, 34], device="cuda")
    last = torch.tensor([-1, 4 + 3 * ps, 16 * 7 + 15, 2 * ps], device="cuda")
    free = torch.tensor([11, 4, 9, 30, 2, 7, 8], device="cuda")
    got = alloc_extend(prefix, seq, last, free, ps)
    from hicache.kernels.slot_alloc import alloc_extend_torch, alloc_decode_torch

    ref = alloc_extend_torch(prefix.cpu(), seq.cpu(), last.cpu(), free.cpu(), ps)
    assert torch.equal(got.slots.cpu(), ref.slots) and got.num_pages == ref.num_pages
    dec_seq = torch.tensor([17, 18, 33], device="cuda")
    dec_last = torch.tensor([15, 16 + 16, 31], device="cuda")
    got = alloc_decode(dec_seq, dec_last, free, ps)
    ref = alloc_decode_torch(dec_seq.cpu(), dec_last.cpu(), free.cpu(), ps)
    assert torch.equal(got.slots.cpu(), ref.slots) and got.num_pages == ref.num_pages
    table = torch.randint(0, 10_000, (5, 3000), dtype=torch.int32, device="cuda")
    rows = torch.tensor([4, 0, 2], device="cuda")
    lens = torch.tensor([2999, 0, 1025], device="cuda")
    from hicache.kernels.kv_indices import build_kv_indices_torch, build_kv_page_indices_torch

    got = build_kv_indices(table, rows, lens)
    ref = build_kv_indices_torch(table.cpu(), rows.cpu(), lens.cpu())
    assert torch.equal(got.indices.cpu(), ref.indices) and torch.equal(got.indptr.cpu(), ref.indptr)
    got = build_kv_page_indices(table, rows, lens, ps)
    ref = build_kv_page_indices_torch(table.cpu(), rows.cpu(), lens.cpu(), ps)
    assert torch.equal(got.indices.cpu(), ref.indices) and torch.equal(got.indptr.cpu(), ref.indptr)


@pytest.mark.gpu
def test_engine_owned_cuda_pool_in_a_vllm_shaped_layout_through_the_daemon(tmp_path):
    """An engine-owned pool in CUDA memory (one allocation, each layer's blocks one run,
    as vLLM 0.32 lays out its KV cache), shared by IPC with a real daemon: store from
    some blocks, load_into others layer by layer (waited on a stream), bytes equal."""
    daemon = DaemonProcess(tmp_path, host={"bytes": 64 * OWNED_SPEC.host_page_bytes},
                           disk={"path": str(tmp_path / "lmdb"), "capacity_bytes": 64 * OWNED_SPEC.host_page_bytes})
    daemon.start()
    layout = layer_major(64)
    exported = export_owned_pool(layout, name="gpu", device="cuda")
    client = CacheClient(daemon.endpoint)
    try:
        client.register_owned(OWNED_SPEC, exported.handle)
        buffer = exported.tensors[0]
        alloc = layout.allocations[0]
        bb = layout.block_bytes

        def block(layer, b):
            start = alloc.layer_offset(layer) + b * alloc.block_stride
            return buffer[start : start + bb]

        tokens = list(range(5 * OWNED_SPEC.page_size))
        src, dst = [3, 9, 4, 20, 7], [40, 41, 2, 63, 5]
        for b in src:
            for layer in range(OWNED_SPEC.num_layers):
                block(layer, b).copy_(torch.randint(0, 256, (bb,), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        assert client.store(tokens, src).num_copied == 5
        m = client.match(tokens)
        assert m.num_host_pages == 5
        client.lock(m.handle)
        done = client.load_into(m.handle, dst)
        stream = torch.cuda.current_stream()
        for layer in range(OWNED_SPEC.num_layers):
            client.wait_layer(done.wait, layer, stream=stream)
        client.unlock(m.handle)
        torch.cuda.synchronize()
        for s, d in zip(src, dst):
            for layer in range(OWNED_SPEC.num_layers):
                assert torch.equal(block(layer, s), block(layer, d)), (s, d, layer)
        client.check()
    finally:
        client.close()
        exported.close()
        daemon.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("block_major", [False, True], ids=["LBHNC", "BLHNC"])
def test_vllm_shaped_cuda_caches_shared_as_the_connector_shares_them(tmp_path, block_major):
    """The vLLM connector's CUDA path without a CUDA vLLM: caches laid out as vLLM 0.32
    lays them out, shared by ``share_kv_caches`` (IPC handles of the allocation as it
    is), described by ``layout_of``; a forward's writes waited for as the connector does
    before a store; an unlocked ``load_into`` waited on vLLM's stream; bytes equal."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    caches, tensors, spec = vllm_kv_caches(names, 64, heads=4, block_size=16, head_dim=64,
                                           block_major=block_major, device="cuda")
    shared = share_kv_caches(caches, tensors)
    assert [m.kind for m in shared.memory] == ["cuda_ipc"]
    daemon = DaemonProcess(tmp_path, host={"bytes": 64 * spec.host_page_bytes}, disk={"enabled": False}).start()
    client = CacheClient(daemon.endpoint)
    try:
        layout = layout_of(spec, 64, tensors, {name: i for i, name in enumerate(names)})
        client.register_owned(spec, OwnedPoolHandle(layout, shared.memory, "vllm-gpu"))
        tokens = list(range(1000, 1000 + 5 * spec.page_size + 7))
        src, dst = [3, 40, 9, 17, 60], [5, 6, 50, 2, 33]
        for b in src + dst:
            for name in names:
                caches[name][b].copy_(torch.randn(caches[name][b].shape, device="cuda").to(caches[name].dtype))
        torch.cuda.current_stream().synchronize()  # (what wait_for_save does before its stores)
        assert client.store(tokens, src).num_copied == 5
        m = client.match(tokens)
        assert m.num_host_pages == 5
        done = client.load_into(m.handle, dst, locked=False)
        assert done.num_loaded_pages == 5
        stream = torch.cuda.current_stream()
        for layer in range(len(names)):
            client.wait_layer(done.wait, layer, stream=stream)
        torch.cuda.synchronize()
        for s, d in zip(src, dst):
            for name in names:
                assert torch.equal(caches[name][d], caches[name][s]), (s, d, name)
        client.check()
    finally:
        client.close()
        daemon.stop()
        shared.close()


@pytest.mark.gpu
def test_daemon_owned_cuda_pools_of_two_engines_through_the_daemon(tmp_path):
    """hicache's own pool protocol on CUDA pools shared by IPC with a real daemon: engine
    A's inserted pages backed up by the daemon's copy stream into its pinned host pool
    and on to disk (``flush``); engine B (a pool of its own) matches them on the host,
    loads them layer by layer, each layer waited on B's stream through the daemon's
    interprocess events; B's pages hold A's bytes. Then the daemon restarts (host tier
    gone) and B loads the same pages from disk."""
    page_bytes = SPEC.host_page_bytes
    daemon = DaemonProcess(tmp_path, host={"bytes": 64 * page_bytes},
                           disk={"path": str(tmp_path / "lmdb"), "capacity_bytes": 64 * page_bytes}).start()
    a, b = export_kv_pool(SPEC, 24, device="cuda"), export_kv_pool(SPEC, 24, device="cuda")
    clients = []
    try:
        ca = CacheClient(daemon.endpoint)
        clients.append(ca)
        ca.register(SPEC, [a.handle])
        gen = torch.Generator(device="cuda").manual_seed(11)
        a.pool.buffer.copy_(torch.randint(0, 256, (a.pool.buffer.numel(),), generator=gen, device="cuda",
                                          dtype=torch.int32).to(torch.uint8))
        torch.cuda.synchronize()
        tokens = list(range(2000, 2000 + 5 * SPEC.page_size + 3))
        pages = ca.alloc(5)
        inserted = ca.insert(tokens, pages)
        source = [int(x) for x in inserted.device_pages]
        assert ca.flush()["not_on_disk_pages"] == 0

        def load_into_b(tier: str) -> None:
            cb = CacheClient(daemon.endpoint)
            clients.append(cb)
            cb.register(SPEC, [b.handle])
            b.pool.buffer.zero_()
            torch.cuda.synchronize()
            m = cb.match(tokens)
            assert m.num_device_pages == 0 and m.num_host_pages + m.num_disk_pages == 5, (tier, m)
            assert (m.num_disk_pages if tier == "disk" else m.num_host_pages) == 5, (tier, m)
            cb.lock(m.handle)
            loaded = cb.load(m.handle)
            assert loaded.num_loaded_pages == 5 and loaded.wait
            stream = torch.cuda.Stream()
            for layer in range(SPEC.num_layers):
                cb.wait_layer(loaded.wait, layer, stream=stream)
            stream.synchronize()
            wrong = [(layer, name, s, int(d)) for layer in range(SPEC.num_layers) for name in ("k", "v")
                     for s, d in zip(source, loaded.device_pages)
                     if not torch.equal(_page_bytes(b.pool, layer, name, int(d)), _page_bytes(a.pool, layer, name, s))]
            assert not wrong, f"{tier}: B's pages hold other bytes than A's: (layer, k/v, A's page, B's page) {wrong}"
            cb.unlock(m.handle)
            cb.check()

        load_into_b("host")
        for client in clients:
            client.close()
        clients.clear()
        assert daemon.stop() == 0, daemon.log.read_text()
        daemon.start()
        load_into_b("disk")
    finally:
        for client in clients:
            client.close()
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
        a.close()
        b.close()
