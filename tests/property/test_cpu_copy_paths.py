"""The CPU copy paths of both movers against a byte-by-byte oracle, on drawn layouts.

Both movers build their reference-path views once per pool and find a copy's page runs
once per load (:class:`~hicache.kernels.page_copy.ReferencePlan`); these properties keep
that exact for any layout and any page list: an engine-owned pool of 1 to 4 allocations,
layer-major or block-major, with offsets, gaps between blocks and layers and slack at
the end (vLLM's CPU and GPU layouts are two of them), and one rank's pool in hicache's
own layout, K and V in regions apart, MLA and SWA layers among them; page lists
unsorted, with runs (longer than a run's cap too), single pages and repeated sources;
1 to 3 copy threads, each given a share wherever it may take one. Every buffer is a
view at an offset, and destinations are filled with random bytes first, so a byte
written where it should not be, or not written, shows.
"""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.foreign import Allocation, ForeignLayout, ForeignMover, ForeignPool
from hicache.kernels.copy_plan import CpuCopyWorkers
from hicache.kernels.page_copy import RUN_CAP_PAGES
from hicache.pools import DeviceLayout, DevicePool, HostPool
from hicache.spec import KVSpec, MHALayer, MLALayer
from hicache.transfer import PageMover

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NUM_HOST_PAGES = 24


def noise(nbytes: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


@st.composite
def page_lists(draw, num_src: int, num_dst: int, src_lo: int = 0, dst_lo: int = 0):
    """Equal-length source and destination ids: runs of consecutive ids (some longer
    than a run's cap) and single pages, in any order; sources may repeat, destinations
    never do."""
    def ids(lo, hi, unique):
        runs = draw(st.lists(st.tuples(st.integers(lo, hi - 1), st.integers(1, RUN_CAP_PAGES + 3)),
                             min_size=1, max_size=6))
        out = [i for start, length in runs for i in range(start, min(hi, start + length))]
        return list(dict.fromkeys(out)) if unique else out

    src, dst = ids(src_lo, num_src, False), ids(dst_lo, num_dst, True)
    n = min(len(src), len(dst))
    return src[:n], dst[:n]


def workers_of(threads: int) -> CpuCopyWorkers | None:
    """Threads that take a share of any copy (none: the calling thread alone)."""
    return CpuCopyWorkers(threads, min_bytes_per_thread=1) if threads > 1 else None


# -- an engine-owned pool --------------------------------------------------------------


@st.composite
def foreign_layouts(draw):
    num_layers = draw(st.integers(1, 5))
    swa = draw(st.lists(st.booleans(), min_size=num_layers, max_size=num_layers))
    spec = KVSpec(page_size=2, model="test/prop", layout="test/prop-blocks", layers=tuple(
        MHALayer(num_kv_heads=1, head_dim=4, dtype="bfloat16", sliding_window=8 if s else 0) for s in swa))
    bb = spec.page_bytes(0)
    num_blocks = draw(st.integers(2, 20))
    order = draw(st.permutations(range(num_layers)))
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), max_size=min(3, num_layers - 1)))) \
        if num_layers > 1 else []
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, num_layers])]
    allocations = []
    for layers in groups:
        block_gap, layer_gap = draw(st.integers(0, 40)), draw(st.integers(0, 40))
        offset, slack = draw(st.integers(0, 64)), draw(st.integers(0, 64))
        if draw(st.booleans()):  # layer-major (vLLM's): each layer's blocks one run
            block_stride = bb + block_gap
            layer_stride = (num_blocks - 1) * block_stride + bb + layer_gap
        else:  # block-major: each block holds its allocation's layers
            layer_stride = bb + layer_gap
            block_stride = (len(layers) - 1) * layer_stride + bb + block_gap
        end = offset + (len(layers) - 1) * layer_stride + (num_blocks - 1) * block_stride + bb
        allocations.append(Allocation(end + slack, tuple(layers), layer_stride, block_stride, offset))
    return ForeignLayout(spec, num_blocks, bb, tuple(allocations))


def block_at(layout: ForeignLayout, buffers, layer: int, block: int) -> np.ndarray:
    a, i = layout.where[layer]
    alloc = layout.allocations[a]
    start = alloc.offset + i * alloc.layer_stride + block * alloc.block_stride
    return buffers[a][start : start + layout.block_bytes]


def host_run(spec: KVSpec, host: np.ndarray, layer: int, page: int) -> np.ndarray:
    """``layer``'s bytes in host page ``page``: its segments, side by side."""
    mine = [s for s in spec.host_page_layout() if s.layer == layer]
    start = page * spec.host_page_bytes + mine[0].offset
    return host[start : start + sum(s.nbytes for s in mine)]


class ForeignRig:
    """A pool whose allocations are slices of larger buffers (a view's offset counts)."""

    def __init__(self, layout: ForeignLayout, seed: int, threads: int) -> None:
        self.layout = layout
        self.whole = [noise(a.size + 16, seed + i) for i, a in enumerate(layout.allocations)]
        self.buffers = self.blocks_of(self.whole)
        self.host = HostPool(layout.spec, NUM_HOST_PAGES, pinned=False)
        self.host.pages.copy_(noise(self.host.pages.numel(), seed + 99))
        self.workers = workers_of(threads)
        self.mover = ForeignMover(ForeignPool(layout, self.buffers, [None] * len(self.buffers)), self.host,
                                  workers=self.workers)

    def state(self):
        return [w.numpy().copy() for w in self.whole], self.host.pages.numpy().copy()

    def blocks_of(self, wholes):
        """The allocations' slices of ``wholes`` (each at 1 to 3 bytes in)."""
        allocations = self.layout.allocations
        return [w[1 + a % 3 : 1 + a % 3 + alloc.size] for a, (w, alloc) in enumerate(zip(wholes, allocations))]

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
        self.host.close()


@SETTINGS
@given(layout=foreign_layouts(), data=st.data(), threads=st.integers(1, 3), seed=st.integers(0, 1000))
def test_an_engine_owned_pools_store_writes_exactly_its_blocks_into_the_host_pages(layout, data, threads, seed):
    rig = ForeignRig(layout, seed, threads)
    try:
        blocks, pages = data.draw(page_lists(layout.num_blocks, NUM_HOST_PAGES))
        wholes, host = rig.state()
        engine = rig.blocks_of(wholes)
        for b, h in zip(blocks, pages):
            for layer in range(layout.spec.num_layers):
                host_run(layout.spec, host, layer, h)[:] = block_at(layout, engine, layer, b)
        rig.mover.backup(blocks, pages)
        assert np.array_equal(rig.host.pages.numpy(), host)
        assert all(np.array_equal(w.numpy(), e) for w, e in zip(rig.whole, wholes))  # the source unchanged
    finally:
        rig.close()


@SETTINGS
@given(layout=foreign_layouts(), data=st.data(), threads=st.integers(1, 3), seed=st.integers(0, 1000))
def test_an_engine_owned_pools_layer_wise_load_lands_each_layer_whole_before_reporting_it(layout, data, threads,
                                                                                         seed):
    rig = ForeignRig(layout, seed, threads)
    try:
        pages, blocks = data.draw(page_lists(NUM_HOST_PAGES, layout.num_blocks))
        wholes, host = rig.state()
        engine = rig.blocks_of(wholes)
        for h, b in zip(pages, blocks):
            for layer in range(layout.spec.num_layers):
                block_at(layout, engine, layer, b)[:] = host_run(layout.spec, host, layer, h)
        reported = []

        def on_layer(layer):
            for b in blocks:  # every page of the layer landed, on every thread
                assert np.array_equal(block_at(layout, rig.buffers, layer, b).numpy(),
                                      block_at(layout, engine, layer, b))
            reported.append(layer)

        rig.mover.load(pages, blocks, on_layer=on_layer)
        assert reported == list(range(layout.spec.num_layers))
        assert all(np.array_equal(w.numpy(), e) for w, e in zip(rig.whole, wholes))
        assert np.array_equal(rig.host.pages.numpy(), host)
    finally:
        rig.close()


@SETTINGS
@given(layout=foreign_layouts(), data=st.data(), threads=st.integers(1, 3), seed=st.integers(0, 1000))
def test_an_engine_owned_pools_one_layer_load_writes_that_layers_blocks_only(layout, data, threads, seed):
    rig = ForeignRig(layout, seed, threads)
    try:
        pages, blocks = data.draw(page_lists(NUM_HOST_PAGES, layout.num_blocks))
        layer = data.draw(st.integers(0, layout.spec.num_layers - 1))
        wholes, host = rig.state()
        engine = rig.blocks_of(wholes)
        for h, b in zip(pages, blocks):
            block_at(layout, engine, layer, b)[:] = host_run(layout.spec, host, layer, h)
        rig.mover.load_layer(pages, blocks, layer)
        assert all(np.array_equal(w.numpy(), e) for w, e in zip(rig.whole, wholes))
    finally:
        rig.close()


# -- hicache's own pool ------------------------------------------------------------------


@st.composite
def own_specs(draw):
    layers = []
    for _ in range(draw(st.integers(1, 4))):
        window = draw(st.sampled_from([0, 0, 8]))
        if draw(st.booleans()):  # K and V in regions of their own
            layers.append(MHALayer(num_kv_heads=draw(st.integers(1, 2)), head_dim=draw(st.sampled_from([2, 4, 6])),
                                   dtype=draw(st.sampled_from(["float16", "float32"])), sliding_window=window))
        else:
            layers.append(MLALayer(kv_lora_rank=draw(st.sampled_from([3, 6])), qk_rope_head_dim=2))
    return KVSpec(page_size=draw(st.integers(1, 3)), model="test/prop", layers=tuple(layers),
                  tp_size=draw(st.sampled_from([1, 1, 2])))


def region_page(buffer: np.ndarray, region, page: int) -> np.ndarray:
    start = region.offset + page * region.unit_bytes
    return buffer[start : start + region.unit_bytes]


def host_segment(spec: KVSpec, host: np.ndarray, region, page: int, rank: int) -> np.ndarray:
    (seg,) = [s for s in spec.host_page_layout() if (s.rank, s.layer, s.component) == (rank, region.layer,
                                                                                        region.component)]
    start = page * spec.host_page_bytes + seg.offset
    return host[start : start + seg.nbytes]


class OwnRig:
    """One rank's pool (the last rank of a TP group), on a view at an offset."""

    def __init__(self, spec: KVSpec, num_pages: int, seed: int, threads: int) -> None:
        self.spec = spec
        self.rank = spec.tp_size - 1
        self.layout = DeviceLayout.build(spec, num_pages)
        self.whole = noise(self.layout.nbytes + 16, seed)
        self.pool = DevicePool(self.layout, self.whole[8:], rank=self.rank)
        self.host = HostPool(spec, NUM_HOST_PAGES, pinned=False)
        self.host.pages.copy_(noise(self.host.pages.numel(), seed + 99))
        self.workers = workers_of(threads)
        self.mover = PageMover(self.pool, self.host, workers=self.workers)

    def device(self, whole: np.ndarray) -> np.ndarray:
        return whole[8:]

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
        self.host.close()


@SETTINGS
@given(spec=own_specs(), num_pages=st.integers(1, 20), data=st.data(), threads=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_a_pools_backup_writes_exactly_its_pages_into_the_host_pages(spec, num_pages, data, threads, seed):
    rig = OwnRig(spec, num_pages, seed, threads)
    try:
        src, dst = data.draw(page_lists(num_pages + 1, NUM_HOST_PAGES))
        whole, host = rig.whole.numpy().copy(), rig.host.pages.numpy().copy()
        for s, d in zip(src, dst):
            for region in rig.layout.token_regions:
                host_segment(spec, host, region, d, rig.rank)[:] = region_page(rig.device(whole), region, s)
        rig.mover.backup(src, dst)
        assert np.array_equal(rig.host.pages.numpy(), host)
        assert np.array_equal(rig.whole.numpy(), whole)
    finally:
        rig.close()


@SETTINGS
@given(spec=own_specs(), num_pages=st.integers(1, 20), data=st.data(), threads=st.integers(1, 3),
       seed=st.integers(0, 1000), whole_load=st.booleans())
def test_a_pools_load_lands_each_layer_whole_before_reporting_it(spec, num_pages, data, threads, seed, whole_load):
    rig = OwnRig(spec, num_pages, seed, threads)
    try:
        src, dst = data.draw(page_lists(NUM_HOST_PAGES, num_pages + 1, dst_lo=1))
        whole, host = rig.whole.numpy().copy(), rig.host.pages.numpy().copy()
        for s, d in zip(src, dst):
            for region in rig.layout.token_regions:
                region_page(rig.device(whole), region, d)[:] = host_segment(spec, host, region, s, rig.rank)
        reported = []

        def on_layer(layer):
            for region in rig.layout.token_regions:
                if region.layer == layer:
                    for d in dst:
                        assert np.array_equal(region_page(rig.pool.buffer.numpy(), region, d),
                                              region_page(rig.device(whole), region, d))
            reported.append(layer)

        if whole_load:
            rig.mover.load_all(src, dst)
        else:
            rig.mover.load(src, dst, on_layer=on_layer)
            assert reported == list(range(spec.num_layers))
        assert np.array_equal(rig.whole.numpy(), whole)
        assert np.array_equal(rig.host.pages.numpy(), host)
    finally:
        rig.close()
