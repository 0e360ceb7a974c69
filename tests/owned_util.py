"""Engines that own their KV blocks (vLLM-style), in their own layouts, for tests."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from types import SimpleNamespace

import numpy as np

from hicache.client import CacheClient
from hicache.engine.kv_pool import export_owned_pool
from hicache.foreign import Allocation, ForeignLayout
from hicache.spec import KVSpec

OWNED_SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16, page_size=8, dtype="bfloat16",
                        model="test/owned", layout="test/opaque-blocks")
BLOCK_BYTES = OWNED_SPEC.page_bytes(0)


def tp_rank_spec(rank: int, tp: int, spec: KVSpec = OWNED_SPEC) -> KVSpec:
    """TP rank ``rank``'s shard of ``spec`` (in the layout, as vLLM's connector names it):
    ranks never share pages."""
    return dataclasses.replace(spec, layout=f"{spec.layout}/tp{rank}of{tp}")


def layer_major(num_blocks: int, spec: KVSpec = OWNED_SPEC, offset: int = 0) -> ForeignLayout:
    """vLLM's CPU layout: one allocation, each layer's blocks one run."""
    bb = spec.page_bytes(0)
    layers = tuple(range(spec.num_layers))
    return ForeignLayout(spec, num_blocks, bb, (
        Allocation(offset + len(layers) * num_blocks * bb, layers, num_blocks * bb, bb, offset),))


def split_layout(num_blocks: int, spec: KVSpec = OWNED_SPEC) -> ForeignLayout:
    """Two allocations: layer 0 alone (a gap between blocks), the others block-major."""
    bb = spec.page_bytes(0)
    rest = tuple(range(1, spec.num_layers))
    return ForeignLayout(spec, num_blocks, bb, (
        Allocation(num_blocks * (bb + 64), (0,), 0, bb + 64),
        Allocation(128 + num_blocks * len(rest) * bb, rest, bb, len(rest) * bb, 128),
    ))


def per_layer(num_blocks: int, spec: KVSpec = OWNED_SPEC) -> ForeignLayout:
    """vLLM's layout on a GPU: one allocation per layer (here each at an offset of its
    own, with a gap after every block)."""
    bb = spec.page_bytes(0)
    return ForeignLayout(spec, num_blocks, bb, tuple(
        Allocation(32 * layer + num_blocks * (bb + 16), (layer,), 0, bb + 16, 32 * layer)
        for layer in range(spec.num_layers)))


def content(tokens, page: int, layer: int, nbytes: int = BLOCK_BYTES) -> np.ndarray:
    """The bytes an engine computes for ``page`` of ``layer`` after ``tokens``' prefix."""
    prefix = np.asarray(tokens[: (page + 1) * OWNED_SPEC.page_size], dtype=np.int32).tobytes()
    seed = int.from_bytes(hashlib.blake2b(prefix + bytes([layer]), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class OwnedEngine:
    """A worker with its own blocks in shared memory, registered as an engine-owned pool."""

    def __init__(self, endpoint: str, layout: ForeignLayout, name: str = "", *, kv_events: bool = True,
                 counts_tokens: bool = True, **client_args) -> None:
        self.layout = layout
        self.name = name
        self.exported = export_owned_pool(layout, name=name)
        self.client = CacheClient(endpoint, **client_args)
        try:
            self.client.register_owned(layout.spec, dataclasses.replace(self.exported.handle, kv_events=kv_events,
                                                                       counts_tokens=counts_tokens))
        except BaseException:
            self.close()
            raise

    def block(self, layer: int, block: int) -> np.ndarray:
        a, i = self.layout.where[layer]
        alloc = self.layout.allocations[a]
        start = alloc.layer_offset(i) + block * alloc.block_stride
        return self.exported.tensors[a].numpy()[start : start + self.layout.block_bytes]

    def compute(self, tokens, blocks, first: int = 0) -> None:
        """Write the KV of pages ``first ..`` into ``blocks``."""
        for i, block in enumerate(blocks):
            for layer in range(self.layout.spec.num_layers):
                self.block(layer, block)[:] = content(tokens, first + i, layer)

    def check(self, tokens, blocks, first: int = 0, layers=None) -> None:
        for i, block in enumerate(blocks):
            for layer in layers if layers is not None else range(self.layout.spec.num_layers):
                assert np.array_equal(self.block(layer, block), content(tokens, first + i, layer)), (
                    f"page {first + i} of layer {layer} in block {block} is wrong")

    def wipe(self, blocks) -> None:
        for block in blocks:
            for layer in range(self.layout.spec.num_layers):
                self.block(layer, block)[:] = 0

    def close(self) -> None:
        self.client.close()
        self.exported.close()


def registered_again(engines, timeout_s: float = 30.0) -> None:
    """After a daemon restart: each engine's pool registered with the new daemon (what
    vLLM's connector does on the worker's side: revive a degraded client until it is)."""
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        while engine.client.degraded or engine.client.epoch < 2:
            assert time.monotonic() < deadline, "a pool never registered again"
            engine.client.revive()
            time.sleep(0.05)


def vllm_kv_caches(layer_names, num_blocks: int, *, heads: int = 2, block_size: int = 8, head_dim: int = 16,
                   block_major: bool = False, device: str = "cpu", dtype=None):
    """A KV cache as vLLM 0.32 allocates it, without vLLM: one flat int8 buffer (a
    ``KVCacheTensor``-shaped description of it) and one ``[B, H, N, 2 * head_dim]`` view per
    layer, layer-major (``LBHNC``: each layer's blocks one run) or block-major
    (``BLHNC``: each block holds every layer's page). The spec that describes it too."""
    import torch

    dtype = dtype or torch.bfloat16
    esize = torch.empty(0, dtype=dtype).element_size()
    page = heads * block_size * 2 * head_dim * esize
    layers = len(layer_names)
    layer_stride, block_stride = (page, layers * page) if block_major else (num_blocks * page, page)
    size = layers * num_blocks * page
    flat = torch.zeros(size, dtype=torch.int8, device=device)
    caches = {}
    for i, name in enumerate(layer_names):
        view = flat.view(dtype).as_strided(
            (num_blocks, heads, block_size, 2 * head_dim),
            (block_stride // esize, block_size * 2 * head_dim, 2 * head_dim, 1), i * layer_stride // esize)
        caches[name] = view
    tensor = SimpleNamespace(size=size, layers=list(layer_names), layer_stride=layer_stride,
                             block_stride=block_stride, offset=0)
    spec = KVSpec.mha(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, page_size=block_size,
                      dtype=str(dtype).removeprefix("torch."), model="test/vllm-shaped",
                      layout=f"vllm/{device}/{'BLHNC' if block_major else 'LBHNC'}/test")
    return caches, [tensor], spec


def as_older_daemon(monkeypatch, hello_field: str) -> list:
    """The client sees hellos without ``hello_field`` (a daemon older than it, which
    refuses the fields it names); returns the list every message the clients send from
    now on is appended to."""
    from hicache import protocol as p

    decode_reply = p.decode_reply

    def older(frame):
        reply = decode_reply(frame)
        if isinstance(reply, p.HelloReply):
            setattr(reply, hello_field, False)
        return reply

    monkeypatch.setattr(p, "decode_reply", older)
    sent = []
    send = CacheClient._send_locked
    monkeypatch.setattr(CacheClient, "_send_locked", lambda client, m: sent.append(m) or send(client, m))
    return sent
