"""Engine-owned pools below the daemon: the tree's host-path insert (an engine's store),
the foreign layout's copy plan, and the mover over CPU copy threads."""

import numpy as np
import pytest
import torch

from hicache.errors import InvalidArgument, ResidencyError
from hicache.foreign import Allocation, ForeignLayout, ForeignMover, ForeignPool
from hicache.keys import namespace_id
from hicache.kernels.copy_plan import CpuCopyWorkers
from hicache.pools import HostPool
from hicache.tree import HiRadixTree, Tier
from owned_util import BLOCK_BYTES, OWNED_SPEC, layer_major, per_layer, split_layout
from tiers_util import watched_copyto
from tree_util import evict

NS = namespace_id(b"model-fp")
PS = 4


@pytest.fixture
def tree():
    t = HiRadixTree()
    t.add_namespace(NS, PS)
    yield t
    t.check_invariants()


def test_add_host_path_extends_a_host_prefix_and_returns_duplicates(tree):
    tokens = list(range(6 * PS))
    node, dup = tree.add_host_path(NS, tokens[: 3 * PS], 0, [10, 11, 12])
    assert len(dup) == 0 and node.num_pages == 3
    # Pages 0-2 on host already: a store of 0-5 that copied 2-5 (2 is a duplicate).
    node, dup = tree.add_host_path(NS, tokens, 2, [20, 21, 22, 23])
    assert dup.tolist() == [20]
    m = tree.match(NS, tokens, 0)
    assert m.num_host_pages == 6 and m.node is node
    tree.check_invariants()
    path = [n.host_pages.tolist() for n in tree.path(node)]
    assert sum(path, []) == [10, 11, 12, 21, 22, 23]


def test_add_host_path_refuses_a_gap_before_the_stored_pages(tree):
    tokens = list(range(4 * PS))
    with pytest.raises(ResidencyError):
        tree.add_host_path(NS, tokens, 2, [1, 2])  # pages 0-1 are nowhere
    tree.add_host_path(NS, tokens[:PS], 0, [5])
    evict(tree, Tier.HOST, 1)  # gone again
    with pytest.raises(ResidencyError):
        tree.add_host_path(NS, tokens, 1, [1, 2, 3])
    with pytest.raises(InvalidArgument):
        tree.add_host_path(NS, tokens, 0, [1, 2])  # two host pages for four pages
    assert len(tree) == 0


def test_add_host_path_cuts_a_host_node_across_the_first_stored_page(tree):
    tokens = list(range(5 * PS))
    tree.add_host_path(NS, tokens[: 3 * PS], 0, [1, 2, 3])
    node, dup = tree.add_host_path(NS, tokens, 1, [7, 8, 9, 10])
    assert dup.tolist() == [7, 8]  # pages 1 and 2 were on host
    assert sum((n.host_pages.tolist() for n in tree.path(node)), []) == [1, 2, 3, 9, 10]


def test_add_host_path_cuts_a_node_on_host_and_disk_that_keeps_no_tokens(tree):
    """The node across the first stored page is on host and disk (so it keeps no
    tokens): the part cut off its front keeps none either."""
    tokens = list(range(5 * PS))
    node, _ = tree.add_host_path(NS, tokens[: 3 * PS], 0, [1, 2, 3])
    tree.add_disk(node)
    assert not node.tokens
    end, dup = tree.add_host_path(NS, tokens, 1, [7, 8, 9, 10])
    assert dup.tolist() == [7, 8]
    tree.check_invariants()
    assert [n.num_pages for n in tree.path(end)] == [1, 2, 2]
    assert sum((n.host_pages.tolist() for n in tree.path(end)), []) == [1, 2, 3, 9, 10]


def test_add_host_path_refuses_pages_after_a_prefix_that_branches_off_a_host_node(tree):
    """The tokens before the first stored page leave a host node inside it: those pages
    are not on host, and the refusal changes nothing."""
    tokens = list(range(4 * PS))
    tree.add_host_path(NS, tokens, 0, [1, 2, 3, 4])
    other = tokens[: 2 * PS] + list(range(900, 900 + 2 * PS))  # pages 0-1 on host, page 2 nowhere
    with pytest.raises(ResidencyError):
        tree.add_host_path(NS, other, 3, [9])
    tree.check_invariants()
    assert tree.match(NS, other, 0).num_host_pages == 2 and len(tree) == 2


def test_a_layer_major_layout_maps_each_block_to_its_layers_run_of_a_host_page():
    layout = layer_major(10)
    for layer in range(OWNED_SPEC.num_layers):
        a, segments = layout.layer_segments(layer)
        assert a == 0
        assert segments.src_offset == (layer * 10 * BLOCK_BYTES,) and segments.src_stride == (BLOCK_BYTES,)
        assert segments.dst_offset == (layer * BLOCK_BYTES,) and segments.dst_stride == (OWNED_SPEC.host_page_bytes,)
    assert layout.num_pages == 9


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("make", [layer_major, split_layout, per_layer])
@pytest.mark.parametrize("min_bytes", [1, 1 << 30], ids=["spread", "one-thread"])
def test_mover_round_trip_is_byte_exact_and_reports_every_layer_in_order(threads, make, min_bytes):
    layout = make(12)
    buffers = [torch.randint(0, 256, (a.size,), dtype=torch.uint8) for a in layout.allocations]
    pool = ForeignPool(layout, buffers, [None] * len(buffers))
    host = HostPool(OWNED_SPEC, 8, pinned=False)
    workers = CpuCopyWorkers(threads, min_bytes_per_thread=min_bytes) if threads > 1 else None
    mover = ForeignMover(pool, host, workers=workers)
    try:
        before = [b.clone() for b in buffers]
        mover.backup([3, 7, 1, 11], [0, 5, 2, 7])
        layers = []
        mover.load([0, 5, 2, 7], [9, 2, 4, 6], on_layer=layers.append)
        assert layers == list(range(OWNED_SPEC.num_layers))

        def block(bufs, layer, b):
            a, i = layout.where[layer]
            alloc = layout.allocations[a]
            start = alloc.layer_offset(i) + b * alloc.block_stride
            return bufs[a][start : start + BLOCK_BYTES]

        for src, dst in ((3, 9), (7, 2), (1, 4), (11, 6)):
            for layer in range(OWNED_SPEC.num_layers):
                assert torch.equal(block(buffers, layer, dst), block(before, layer, src))
        untouched = [b for b in range(12) if b not in (9, 2, 4, 6)]
        for b in untouched:
            for layer in range(OWNED_SPEC.num_layers):
                assert torch.equal(block(buffers, layer, b), block(before, layer, b))
        with pytest.raises(InvalidArgument):
            mover.load([0], [12])  # past the last block
        assert np.array_equal(host.page(0).numpy()[:BLOCK_BYTES], block(before, 0, 3).numpy())
    finally:
        if workers is not None:
            workers.close()
        host.close()


@pytest.mark.parametrize("spare", [0, BLOCK_BYTES], ids=["exact", "spare-block"])
def test_a_mover_refuses_block_ids_past_the_pools_blocks_where_its_buffers_have_the_bytes(spare):
    """In a layer-major allocation, block ``num_blocks`` of one layer is block 0 of the
    next; with spare bytes at the allocation's end (its size is the engine's to say), it
    lies inside the buffer for every layer. It is no block of the pool either way: a
    store from it and a load into it, whole or one layer, are refused, nothing copied."""
    bb, layers = BLOCK_BYTES, tuple(range(OWNED_SPEC.num_layers))
    layout = ForeignLayout(OWNED_SPEC, 4, bb, (Allocation(len(layers) * 4 * bb + spare, layers, 4 * bb, bb),))
    buffers = [torch.randint(0, 256, (a.size,), dtype=torch.uint8) for a in layout.allocations]
    host = HostPool(OWNED_SPEC, 4, pinned=False)
    host.pages.copy_(torch.randint(0, 256, (host.pages.numel(),), dtype=torch.uint8))
    mover = ForeignMover(ForeignPool(layout, buffers, [None] * len(buffers)), host)
    try:
        pool_before, host_before = buffers[0].clone(), host.pages.clone()
        with pytest.raises(InvalidArgument, match=r"page 4\b"):
            mover.backup([4], [1])
        with pytest.raises(InvalidArgument, match=r"page 4\b"):
            mover.load([1], [4])
        with pytest.raises(InvalidArgument, match=r"page 4\b"):
            mover.load_layer([1], [4], 0)
        assert torch.equal(buffers[0], pool_before) and torch.equal(host.pages, host_before)
        mover.load_layer([1], [3], 0)  # (the last block is one)
        assert not torch.equal(buffers[0], pool_before)
    finally:
        host.close()


def test_a_layout_checks_what_it_describes():
    bb = BLOCK_BYTES
    with pytest.raises(InvalidArgument, match="overlap"):
        ForeignLayout(OWNED_SPEC, 4, bb, (Allocation(100 * bb, (0, 1, 2), 2 * bb, bb),))
    with pytest.raises(InvalidArgument, match="past its size"):
        ForeignLayout(OWNED_SPEC, 4, bb, (Allocation(12 * bb - 1, (0, 1, 2), 4 * bb, bb),))
    ForeignLayout(OWNED_SPEC, 4, bb, (Allocation(12 * bb, (0, 1, 2), 4 * bb, bb),))  # exactly fits
    ForeignLayout(OWNED_SPEC, 4, bb, (Allocation(12 * bb, (0, 1, 2), bb, 3 * bb),))  # block-major


@pytest.mark.parametrize("fail_at", [1, 4, 9, 17])
@pytest.mark.parametrize("make", [layer_major, per_layer])
def test_a_layer_wise_load_whose_copy_fails_reports_only_what_landed_and_ends_after_every_thread(make, fail_at,
                                                                                               monkeypatch):
    """Three copy threads; the ``fail_at``-th strided copy raises. The load raises only
    once no thread copies any more (its caller then fails the ticket's other layers, and
    the engine may reuse the blocks), and every layer it reported had landed on every
    thread: a layer a thread never finished is never reported."""
    import threading

    from hicache.kernels import page_copy

    layout = make(12)
    buffers = [torch.randint(0, 256, (a.size,), dtype=torch.uint8) for a in layout.allocations]
    host = HostPool(OWNED_SPEC, 8, pinned=False)
    host.pages.copy_(torch.randint(0, 256, (host.pages.numel(),), dtype=torch.uint8))
    workers = CpuCopyWorkers(3, min_bytes_per_thread=1)
    mover = ForeignMover(ForeignPool(layout, buffers, [None] * len(buffers)), host, workers=workers)
    pages, blocks = [0, 5, 2, 7, 3, 4], [9, 2, 4, 6, 1, 10]
    calls, active = [0], [0]

    def count_or_fail(dst, src):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("copy failed")

    failing_copyto = watched_copyto(threading.Lock(), active, count_or_fail)

    def block(layer, b):
        a, i = layout.where[layer]
        alloc = layout.allocations[a]
        start = alloc.layer_offset(i) + b * alloc.block_stride
        return buffers[a][start : start + BLOCK_BYTES]

    def expected(layer, h):
        start = h * OWNED_SPEC.host_page_bytes + layout.host_offset[layer]
        return host.pages[start : start + BLOCK_BYTES]

    reported = []

    def on_layer(layer):
        for h, b in zip(pages, blocks):
            assert torch.equal(block(layer, b), expected(layer, h)), f"layer {layer} reported, block {b} not landed"
        reported.append(layer)

    monkeypatch.setattr(page_copy.np, "copyto", failing_copyto)
    try:
        with pytest.raises(RuntimeError, match="copy failed"):
            mover.load(pages, blocks, on_layer=on_layer)
        assert active[0] == 0  # no copy of the load runs once it has raised
        ended_at = calls[0]
        workers.close()
        assert calls[0] == ended_at  # nor starts after
        assert reported == list(range(len(reported))) and len(reported) < OWNED_SPEC.num_layers
    finally:
        workers.close()
        host.close()
