"""vLLM's KV cache as an engine-owned pool (``hicache.integrations.vllm_kv``), without
vLLM: vLLM-shaped caches moved into shared memory with every layer view still vLLM's,
described in vLLM's own geometry, stored and loaded through a real daemon."""

from types import SimpleNamespace

import pytest
import torch

from daemon_util import DaemonProcess
from hicache.client import CacheClient
from hicache.errors import InvalidArgument
from hicache.integrations.vllm_kv import layout_of, share_kv_caches
from owned_util import vllm_kv_caches

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
INDEX = {name: i for i, name in enumerate(LAYERS)}


def page(caches, layer: int, block: int) -> torch.Tensor:
    """The bytes of one block of one layer, read through vLLM's own view."""
    return caches[LAYERS[layer]][block].contiguous().view(torch.uint8).reshape(-1)


def fill(caches, blocks, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in blocks:
        for name in LAYERS:
            view = caches[name][b]
            view.copy_(torch.randn(view.shape, generator=g, dtype=torch.float32).to(view.dtype))


@pytest.mark.parametrize("block_major", [False, True], ids=["LBHNC", "BLHNC"])
def test_the_cache_moves_into_shared_memory_and_vllms_views_compute_there(block_major):
    caches, tensors, spec = vllm_kv_caches(LAYERS, 10, block_major=block_major)
    fill(caches, range(10), seed=1)
    before = {name: view.clone() for name, view in caches.items()}
    views = dict(caches)  # (the objects vLLM's layers hold)
    shared = share_kv_caches(caches, tensors)
    try:
        (memory,) = shared.memory
        assert memory.kind == "memfd" and memory.nbytes == tensors[0].size
        (buffer,) = shared.buffers
        for name in LAYERS:
            assert caches[name] is views[name]  # rebound in place, not replaced
            assert torch.equal(caches[name], before[name])  # what vLLM had computed came along
            assert caches[name].untyped_storage().data_ptr() == buffer.tensor.data_ptr()
        caches[LAYERS[2]][7].fill_(3.0)  # a forward's write lands in the segment the daemon maps
        layout = layout_of(spec, 10, tensors, INDEX)
        alloc = layout.allocations[0]
        start = alloc.layer_offset(2) + 7 * alloc.block_stride
        assert torch.equal(buffer.tensor[start : start + layout.block_bytes], page(caches, 2, 7))
    finally:
        shared.close()


def test_caches_that_are_not_one_allocation_per_kv_cache_tensor_are_refused():
    caches, tensors, _ = vllm_kv_caches(LAYERS, 4)
    with pytest.raises(InvalidArgument):  # a layer the description names, with no cache
        share_kv_caches({k: v for k, v in caches.items() if k != LAYERS[1]}, tensors)
    with pytest.raises(InvalidArgument):  # a size that is not the allocation's
        share_kv_caches(caches, [SimpleNamespace(**{**vars(tensors[0]), "size": tensors[0].size - 2})])
    moved = dict(caches)
    moved[LAYERS[1]] = caches[LAYERS[1]].clone()  # one layer in an allocation of its own
    with pytest.raises(InvalidArgument):
        share_kv_caches(moved, tensors)
    with pytest.raises(InvalidArgument):  # two descriptions over one allocation (aliasing groups)
        share_kv_caches(caches, [tensors[0], tensors[0]])
    assert all(v.untyped_storage().data_ptr() == caches[LAYERS[0]].untyped_storage().data_ptr()
               for v in caches.values())  # nothing was rebound


@pytest.mark.parametrize("block_major", [False, True], ids=["LBHNC", "BLHNC"])
def test_a_shared_vllm_cache_stores_and_loads_through_the_daemon(tmp_path, block_major):
    caches, tensors, spec = vllm_kv_caches(LAYERS, 16, block_major=block_major)
    shared = share_kv_caches(caches, tensors)
    daemon = DaemonProcess(tmp_path, host={"bytes": 32 * spec.host_page_bytes}, disk={"enabled": False}).start()
    client = CacheClient(daemon.endpoint)
    try:
        from hicache.foreign import OwnedPoolHandle

        client.register_owned(spec, OwnedPoolHandle(layout_of(spec, 16, tensors, INDEX), shared.memory, "vllm-e"))
        tokens = list(range(500, 500 + 4 * spec.page_size + 3))
        src, dst = [3, 9, 1, 12], [5, 14, 2, 7]
        fill(caches, src, seed=2)
        fill(caches, dst, seed=3)  # what the blocks held before
        assert client.store(tokens, src).num_copied == 4
        m = client.match(tokens)
        assert m.num_host_pages == 4
        done = client.load_into(m.handle, dst, locked=False)
        assert done.num_loaded_pages == 4
        for layer in range(len(LAYERS)):
            client.wait_layer(done.wait, layer, timeout_s=30)
        for s, d in zip(src, dst):
            for layer in range(len(LAYERS)):
                assert torch.equal(page(caches, layer, d), page(caches, layer, s)), (s, d, layer)
        client.check()
    finally:
        client.close()
        daemon.stop()
        shared.close()
