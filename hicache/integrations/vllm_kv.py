"""vLLM's KV cache as an engine-owned pool, without importing vLLM.

vLLM (0.32) allocates its KV cache as one flat buffer per ``KVCacheTensor`` (``size``;
``layers``, the names of the layers in it; ``layer_stride``, ``block_stride`` and
``offset`` in bytes) and gives each attention layer a view of its part. This module
turns that into what the daemon maps:

* :func:`layout_of` — the :class:`~hicache.foreign.ForeignLayout` (every layer's blocks
  where vLLM put them; a block is opaque bytes);
* :func:`share_kv_caches` — the memory. On the CPU each buffer is moved into a sealed
  memfd segment (copied, then every layer view that vLLM's layers hold rebound onto it
  at its own offset, so that vLLM computes in shared memory). On CUDA each buffer is
  shared as it is, by a CUDA IPC handle of its allocation (nothing moves).

The connector (:mod:`hicache.integrations.vllm`) uses both; the GPU checks drive them
with vLLM-shaped CUDA tensors, where no CUDA build of vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.errors import InvalidArgument
from hicache.foreign import Allocation, ForeignLayout, SharedMemory
from hicache.shm import SharedBuffer
from hicache.spec import KVSpec


def layout_of(spec: KVSpec, num_blocks: int, kv_cache_tensors: Sequence[Any],
              layer_index: Mapping[str, int]) -> ForeignLayout:
    """The foreign layout of vLLM's ``kv_cache_tensors`` (``KVCacheConfig.kv_cache_tensors``),
    with ``layer_index`` giving each layer name its index in ``spec``."""
    allocations = tuple(
        Allocation(t.size, tuple(layer_index[name] for name in t.layers), t.layer_stride, t.block_stride, t.offset)
        for t in kv_cache_tensors)
    return ForeignLayout(spec, num_blocks, spec.page_bytes(0), allocations)


@dataclass
class SharedKV:
    """vLLM's KV cache as shared: ``memory`` for the pool's handle, one per buffer, in
    ``kv_cache_tensors`` order. Close it (CPU: unmaps this process's segments) only
    once vLLM no longer computes in them."""

    memory: tuple[SharedMemory, ...]
    buffers: list[SharedBuffer] = field(default_factory=list)  # CPU: the memfd segments
    tensors: list[torch.Tensor] = field(default_factory=list)  # CUDA: the buffers shared (kept alive)

    def close(self) -> None:
        self.tensors = []
        for buffer in self.buffers:
            buffer.close()
        self.buffers = []


def share_kv_caches(kv_caches: Mapping[str, torch.Tensor], kv_cache_tensors: Sequence[Any]) -> SharedKV:
    """Share vLLM's KV cache (``kv_caches``: each layer's view, as ``register_kv_caches``
    receives it) with the daemon: see the module docstring."""
    device = next(iter(kv_caches.values())).device
    flats = [_flat(kv_caches, t) for t in kv_cache_tensors]
    if len({flat.untyped_storage().data_ptr() for flat in flats}) != len(flats):
        # Cache groups overlaid on one allocation (hybrid models): one block id would be
        # two pools' pages.
        raise InvalidArgument("several KVCacheTensors share one allocation (overlaid cache groups)")
    if device.type == "cuda":
        from hicache.cuda_ipc import export_tensor

        return SharedKV(tuple(SharedMemory("cuda_ipc", t.size, cuda_ipc=export_tensor(flat))
                              for t, flat in zip(kv_cache_tensors, flats)), tensors=flats)
    if device.type != "cpu":
        raise InvalidArgument(f"cannot share a KV cache on {device}")
    shared = SharedKV(())
    try:
        for t, flat in zip(kv_cache_tensors, flats):
            buffer = SharedBuffer.create(t.size, name="hicache-vllm-kv")
            shared.buffers.append(buffer)
            buffer.tensor.copy_(flat)
            old = flat.untyped_storage()
            storage = buffer.tensor.untyped_storage()
            for view in kv_caches.values():
                if view.untyped_storage().data_ptr() == old.data_ptr():
                    view.set_(storage, view.storage_offset(), view.size(), view.stride())
    except BaseException:
        shared.close()
        raise
    shared.memory = tuple(SharedMemory("memfd", b.nbytes, fd=b.fd) for b in shared.buffers)
    return shared


def _flat(kv_caches: Mapping[str, torch.Tensor], t: Any) -> torch.Tensor:
    """The whole buffer behind ``t``'s layers, as flat bytes (every layer of ``t`` must be a
    view of one allocation of exactly ``t.size`` bytes)."""
    missing = [name for name in t.layers if name not in kv_caches]
    if missing or not t.layers:
        raise InvalidArgument(f"a KVCacheTensor names layers vLLM gave no cache for: {missing}")
    views = [kv_caches[name] for name in t.layers]
    storage = views[0].untyped_storage()
    if storage.nbytes() != t.size or any(v.untyped_storage().data_ptr() != storage.data_ptr() for v in views):
        raise InvalidArgument("a KVCacheTensor's layers do not share one allocation of its size")
    return torch.empty(0, dtype=torch.uint8, device=views[0].device).set_(storage, 0, (t.size,), (1,))
