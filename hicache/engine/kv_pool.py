"""Exporting an engine's KV pool to the daemon.

The engine allocates its whole KV pool (every layer, plus recurrent-state slots) as one
flat buffer laid out by :class:`hicache.pools.DeviceLayout`, uses the typed views of
:class:`hicache.pools.DevicePool` for its forward pass, and sends the
:class:`hicache.pools.PoolHandle` to the daemon at registration. CPU engines get the
buffer in a sealed memfd segment (:mod:`hicache.shm`), which the client library hands
to the daemon as a descriptor: it has no name, so it is gone when the engine and the
daemon have both let go of it (a crash included). CUDA engines get device memory shared
by a CUDA IPC handle.
"""

from __future__ import annotations

import torch

from hicache.errors import InvalidArgument
from hicache.foreign import ForeignLayout, OwnedPoolHandle, SharedMemory
from hicache.pools import DeviceLayout, DevicePool, PoolHandle
from hicache.shm import SharedBuffer
from hicache.spec import KVSpec


class ExportedKVPool:
    """The engine's side of an exported pool: ``pool`` for compute, ``handle`` for the
    daemon (``client.register(spec, [exported.handle])``). Close it when the engine is
    done."""

    def __init__(self, pool: DevicePool, handle: PoolHandle) -> None:
        self.pool = pool
        self.handle = handle

    def close(self) -> None:
        self.pool.close()


def export_kv_pool(
    spec: KVSpec,
    num_pages: int,
    *,
    num_state_slots: int = 0,
    checkpoint_slots: int = 0,
    device: str | torch.device = "cpu",
    rank: int = 0,
) -> ExportedKVPool:
    """Allocate a zeroed KV pool of ``num_pages`` pages (plus the padding page) and
    describe it for the daemon. A spec with state layers: ``num_state_slots`` are the
    engine's (its request rows'), ``checkpoint_slots`` more are lent to hicache for
    checkpoints kept on the device."""
    layout = DeviceLayout.build(spec, num_pages, num_state_slots, checkpoint_slots)
    device = torch.device(device)
    if device.type == "cpu":
        shared = SharedBuffer.create(layout.nbytes, name=f"hicache-kv-rank{rank}")
        pool = DevicePool(layout, shared.tensor, rank=rank, owner=shared)
        handle = PoolHandle("memfd", layout.to_dict(), layout.nbytes, rank, fd=shared.fd)
    elif device.type == "cuda":
        from hicache.cuda_ipc import export_tensor

        buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        pool = DevicePool(layout, buffer, rank=rank)
        handle = PoolHandle("cuda_ipc", layout.to_dict(), layout.nbytes, rank, cuda_ipc=export_tensor(buffer))
    else:
        raise InvalidArgument(f"cannot export a KV pool on {device}")
    return ExportedKVPool(pool, handle)


class ExportedOwnedPool:
    """An engine-owned pool's memory as its engine shares it: ``tensors`` (one flat uint8
    tensor per allocation, for the engine's own views) and ``handle`` for the daemon
    (``client.register_owned(spec, exported.handle)``)."""

    def __init__(self, buffers: list[SharedBuffer], handle: OwnedPoolHandle,
                 tensors: list[torch.Tensor] | None = None) -> None:
        self.buffers = buffers
        self.handle = handle
        self.tensors = tensors if tensors is not None else [b.tensor for b in buffers]

    def close(self) -> None:
        self.tensors = []
        for buffer in self.buffers:
            buffer.close()


def export_owned_pool(layout: ForeignLayout, *, name: str = "",
                      device: str | torch.device = "cpu") -> ExportedOwnedPool:
    """Zeroed shared memory for each allocation of ``layout`` — sealed memfd segments
    on the CPU, CUDA memory shared by IPC handles on a GPU — described for the daemon.
    An engine that allocated its KV cache already moves it in (copies it, then points
    its tensors at these buffers)."""
    device = torch.device(device)
    if device.type == "cuda":
        from hicache.cuda_ipc import export_tensor

        tensors = [torch.zeros(alloc.size, dtype=torch.uint8, device=device) for alloc in layout.allocations]
        memory = tuple(SharedMemory("cuda_ipc", t.numel(), cuda_ipc=export_tensor(t)) for t in tensors)
        return ExportedOwnedPool([], OwnedPoolHandle(layout, memory, name), tensors)
    if device.type != "cpu":
        raise InvalidArgument(f"cannot export an engine-owned pool on {device}")
    buffers: list[SharedBuffer] = []
    try:
        for i, alloc in enumerate(layout.allocations):
            buffers.append(SharedBuffer.create(alloc.size, name=f"hicache-owned-{i}"))
    except BaseException:
        for buffer in buffers:
            buffer.close()
        raise
    memory = tuple(SharedMemory("memfd", b.nbytes, fd=b.fd) for b in buffers)
    return ExportedOwnedPool(buffers, OwnedPoolHandle(layout, memory, name))
