import os

import pytest
import torch

from hicache.engine.kv_pool import export_kv_pool
from hicache.errors import InvalidArgument, SpecMismatch
from hicache.kernels.copy_plan import CpuCopyWorkers
from hicache.pools import ALIGN_BYTES, DeviceLayout, DevicePool, HostPool, PoolHandle
from hicache.shm import SharedBuffer
from hicache.spec import KVSpec, MHALayer, StateLayer
from hicache.transfer import PageMover

SPEC = KVSpec.mha(num_layers=4, num_kv_heads=2, head_dim=8, page_size=4, model="pool-test")


def test_layout_regions_are_aligned_and_disjoint():
    kda = StateLayer(conv_state_shape=(3, 5), temporal_state_shape=(1, 2, 2))
    spec = KVSpec(page_size=3, layers=(kda, MHALayer(num_kv_heads=1, head_dim=3, dtype="float8_e5m2")))
    layout = DeviceLayout.build(spec, num_pages=7, num_state_slots=2)
    regions = sorted(layout.token_regions + layout.state_regions, key=lambda r: r.offset)
    end = 0
    for region in regions:
        assert region.offset % ALIGN_BYTES == 0 and region.offset >= end
        end = region.offset + region.nbytes
    assert end <= layout.nbytes
    k = layout.token_regions[0]
    assert k.shape == (8 * 3, 1, 3) and k.unit_bytes == 3 * 3  # fp8: one byte per element
    assert [r.component for r in layout.state_regions] == ["conv", "temporal"]
    with pytest.raises(InvalidArgument):
        DeviceLayout.build(spec, num_pages=7)  # state layers need state slots
    with pytest.raises(InvalidArgument):
        DeviceLayout.build(SPEC, num_pages=0)


def _segment(exported):
    """How the daemon maps a memfd handle: from a copy of the engine's descriptor."""
    return lambda handle: SharedBuffer.attach(os.dup(exported.handle.fd), handle.nbytes, uid=os.getuid())


def test_export_and_attach_share_the_same_bytes():
    exported = export_kv_pool(SPEC, num_pages=5)
    handle = PoolHandle.from_dict(exported.handle.to_dict())
    assert handle.kind == "memfd" and handle.fd == -1  # the descriptor never travels
    attached = DevicePool.attach(handle, expected=SPEC, segment=_segment(exported))
    try:
        assert attached.segment_id == exported.pool.segment_id is not None
        exported.pool.v_buffer(2)[4:8] = 3.0  # page 1 of layer 2's V, from the engine
        assert bool((attached.v_buffer(2)[4:8] == 3.0).all())
        attached.k_buffer(0)[0:4] = -1.0  # the daemon writes the padding page
        assert bool((exported.pool.k_buffer(0)[0:4] == -1.0).all())
        with pytest.raises(PermissionError):  # sealed: nobody can shrink it under the other
            os.ftruncate(exported.handle.fd, 0)
    finally:
        attached.close()
        exported.close()


def test_attach_refuses_other_specs_and_bad_handles():
    exported = export_kv_pool(SPEC, num_pages=2)
    try:
        other = KVSpec.mha(num_layers=4, num_kv_heads=2, head_dim=8, page_size=4, model="other-weights")
        with pytest.raises(SpecMismatch):
            DevicePool.attach(exported.handle, expected=other)
        bad = exported.handle.to_dict() | {"nbytes": exported.handle.nbytes + 1}
        with pytest.raises(InvalidArgument):
            DevicePool.attach(PoolHandle.from_dict(bad))
        with pytest.raises(InvalidArgument):
            DevicePool.attach(PoolHandle.from_dict(exported.handle.to_dict() | {"kind": "rdma"}))
        with pytest.raises(InvalidArgument):  # a memfd pool is mapped only from an offered descriptor
            DevicePool.attach(exported.handle)
        for extra in ({"shm_name": "../etc/passwd"}, {"fd": 0}, {"rank": True}, {"token": "text"},
                      {"layout": []}, {"cuda_ipc": 3}):
            with pytest.raises(InvalidArgument):  # a descriptor number never comes from the wire
                PoolHandle.from_dict(exported.handle.to_dict() | extra)
        for bad_layout in ({"num_pages": -1}, {"num_pages": 2**40}, {"num_pages": "2"}, {"extra": 1}):
            with pytest.raises(InvalidArgument):
                DevicePool.attach(PoolHandle.from_dict(exported.handle.to_dict()
                                                       | {"layout": exported.handle.layout | bad_layout}))
        with pytest.raises(InvalidArgument):
            DevicePool.attach(PoolHandle.from_dict(exported.handle.to_dict() | {"rank": 1}),
                              segment=_segment(exported))  # outside the spec's TP size
        for data in ({"kind": "memfd"}, [], None):
            with pytest.raises(InvalidArgument):
                PoolHandle.from_dict(data)
    finally:
        exported.close()


def test_host_pool_sizing():
    assert HostPool.num_pages_for(SPEC, nbytes=10 * SPEC.host_page_bytes + 5) == 10
    assert HostPool.num_pages_for(SPEC, ratio=2.5, device_pages=100) == 250
    for kwargs in ({}, {"nbytes": 1, "ratio": 1.0}, {"ratio": 1.0}, {"nbytes": 1}, {"ratio": -1, "device_pages": 3}):
        with pytest.raises(InvalidArgument):
            HostPool.num_pages_for(SPEC, **kwargs)
    pool = HostPool(SPEC, 3, pinned=False)
    assert pool.page(2).numel() == SPEC.host_page_bytes
    with pytest.raises(InvalidArgument):
        pool.page(3)
    pool.close()


def test_a_host_pages_numpy_view_is_the_same_memory_and_not_tracked_by_the_collector():
    import gc

    pool = HostPool(SPEC, 3, pinned=False)
    view = None
    try:
        pool.page(1).copy_(torch.arange(SPEC.host_page_bytes, dtype=torch.int64).to(torch.uint8))
        view = pool.page_array(1)
        assert view.dtype.name == "uint8" and view.shape == (SPEC.host_page_bytes,)
        assert view.tobytes() == pool.page(1).numpy().tobytes()
        view[0] = 200  # one memory: a write through the view shows in the pool
        assert int(pool.page(1)[0]) == 200 and int(pool.page(0)[-1]) == 0
        assert not gc.is_tracked(view) and gc.is_tracked(pool.page(1))
        for bad in (-1, 3):
            with pytest.raises(InvalidArgument):
                pool.page_array(bad)
    finally:
        del view
        pool.close()


@pytest.mark.parametrize("min_bytes", [None, 1, 1 << 30], ids=["no-workers", "spread", "one-thread"])
def test_page_mover_round_trip_in_process(min_bytes):
    exported = export_kv_pool(SPEC, num_pages=6)
    host = HostPool(SPEC, 4, pinned=False)
    workers = None if min_bytes is None else CpuCopyWorkers(2, min_bytes_per_thread=min_bytes)
    mover = PageMover(exported.pool, host, workers=workers)
    buf = exported.pool.buffer
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
    before = buf.clone()
    mover.backup([3, 1], [2, 0])
    layers = []
    mover.load([2, 0], [5, 6], on_layer=layers.append)
    assert layers == [0, 1, 2, 3]
    # Random bytes are not all valid fp16: compare the bytes, through the typed views.
    for layer in range(4):
        for name in ("k", "v"):
            view = exported.pool.buffer_of(layer, name).view(torch.int16)
            assert torch.equal(view[5 * 4 : 6 * 4], view[3 * 4 : 4 * 4])
            assert torch.equal(view[6 * 4 : 7 * 4], view[1 * 4 : 2 * 4])
    untouched = [p for p in range(7) if p not in (5, 6)]
    for region in exported.pool.layout.token_regions:
        for page in untouched:
            start = region.offset + page * region.unit_bytes
            assert torch.equal(buf[start : start + region.unit_bytes], before[start : start + region.unit_bytes])
    if workers is not None:
        workers.close()
    host.close()
    exported.close()


def test_a_page_mover_refuses_page_ids_past_the_pools_pages():
    """A device pool's regions start 256-byte aligned: past its last page (``num_pages``)
    lie a region's padding, then the next region's pages — inside the buffer, outside
    the pool's pages. A load into them, a backup from them, whole or one layer, is
    refused, nothing copied."""
    exported = export_kv_pool(SPEC, num_pages=6)
    host = HostPool(SPEC, 4, pinned=False)
    mover = PageMover(exported.pool, host)
    try:
        buf = exported.pool.buffer
        buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
        host.pages.copy_(torch.randint(0, 256, (host.pages.numel(),), dtype=torch.uint8))
        pool_before, host_before = buf.clone(), host.pages.clone()
        for call in (lambda: mover.load([1], [7]), lambda: mover.load_all([1], [7]),
                     lambda: mover.load_layer([1], [8], 0), lambda: mover.backup([7], [1])):
            with pytest.raises(InvalidArgument, match=r"page [78]\b"):
                call()
        assert torch.equal(buf, pool_before) and torch.equal(host.pages, host_before)
        mover.load_layer([1], [6], 0)  # (the last page is one)
        assert not torch.equal(buf, pool_before)
    finally:
        host.close()
        exported.close()


def test_pinning_a_host_pool_reports_progress_chunk_by_chunk(monkeypatch):
    """Pinned host pools are registered with CUDA in chunks, reporting the bytes done
    after each (a daemon feeds its watchdog from it); a failed chunk unpins the rest.
    CUDA's runtime is replaced by a recorder: this runs without a GPU."""
    import hicache.pools

    class Cudart:
        def __init__(self, fail_at=None):
            self.registered, self.fail_at = [], fail_at

        def cudaHostRegister(self, ptr, size, flags):
            if len(self.registered) == self.fail_at:
                return 2  # cudaErrorMemoryAllocation
            assert flags == 0x01 | 0x02
            self.registered.append((ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            self.registered = [(p, s) for p, s in self.registered if p != ptr]
            return 0

    chunk = 3 * SPEC.host_page_bytes
    monkeypatch.setattr(hicache.pools, "PIN_CHUNK_BYTES", chunk)
    cudart = Cudart()
    monkeypatch.setattr(hicache.pools.torch.cuda, "cudart", lambda: cudart)
    progress = []
    pool = HostPool(SPEC, 7, pinned=True, progress=progress.append)
    nbytes = 7 * SPEC.host_page_bytes
    assert progress == [chunk, 2 * chunk, nbytes]
    base = pool.buffer.data_ptr()
    assert cudart.registered == [(base, chunk), (base + chunk, chunk), (base + 2 * chunk, nbytes - 2 * chunk)]
    pool.close()
    assert cudart.registered == []

    cudart = Cudart(fail_at=1)
    progress.clear()
    with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
        HostPool(SPEC, 7, pinned=True, progress=progress.append)
    assert progress == [chunk] and cudart.registered == []
