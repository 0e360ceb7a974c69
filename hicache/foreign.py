"""Engine-owned pools in the engine's own layout (vLLM's KV blocks, for one).

An engine that allocates its own KV blocks describes them by its own geometry instead of
hicache's :class:`~hicache.pools.DeviceLayout`: one or more backing *allocations*, each
holding some layers, where block ``b`` of the allocation's ``i``-th layer is the
``block_bytes`` bytes at::

    offset + i * layer_stride + b * block_stride

which is exactly vLLM 0.32's ``KVCacheTensor`` (``size``, ``layers``, ``layer_stride``,
``block_stride``, ``offset``). A block is opaque bytes — vLLM's CPU backend may pack
the inside of a block for AMX — and must hold exactly one page of its layer
(``spec.page_bytes(layer)``): on the host it becomes that layer's run of the host page
(the layer's K and V segments, which lie side by side there). The spec's ``layout``
names the engine's packing, so pages of two layouts never share a fingerprint.

Block ids are the engine's: ``1 .. num_blocks - 1`` (block 0 is the engine's null
block, as page 0 is hicache's padding page), checked like page ids.

:class:`ForeignLayout` is the description (checked: every KV layer exactly once, every
block inside its allocation, no two blocks overlapping); :class:`OwnedPoolHandle` what
an engine sends to register one (the layout, one shared buffer per allocation, and an
optional name other sessions of the engine attach by); :class:`ForeignPool` the daemon's
mapping of it; :class:`ForeignMover` moves pages between it and the host pool with the
same copy kernels and CPU copy threads as a :class:`~hicache.transfer.PageMover`, and
the same interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.errors import InvalidArgument, SpecMismatch
from hicache.kernels.copy_plan import CpuCopyWorkers, Segments, check_page_ids
from hicache.kernels.page_copy import DEFAULT_MAX_PROGRAMS, ReferencePlan, copy_pages, page_runs
from hicache.pools import MAX_POOL_PAGES, HostPool
from hicache.spec import KVSpec
from hicache.transfer import ids_on, planned_layers, spread_layers

MAX_ALLOCATIONS = 1024
MAX_NAME = 256  # characters of a pool's name
_I64 = 1 << 62  # sizes and strides beyond this are nonsense (and would overflow int64 offsets)


def _int(name: str, value: Any, lo: int = 0) -> int:
    if type(value) is not int or not lo <= value < _I64:
        raise InvalidArgument(f"{name} must be an int in [{lo}, 2^62), got {value!r}")
    return value


@dataclass(frozen=True)
class Allocation:
    """One backing allocation: ``layers`` (spec layer indices, in order) at
    ``offset + i * layer_stride + b * block_stride``, ``size`` bytes in all."""

    size: int
    layers: tuple[int, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "layers": list(self.layers), "layer_stride": self.layer_stride,
                "block_stride": self.block_stride, "offset": self.offset}

    def layer_offset(self, i: int) -> int:
        return self.offset + i * self.layer_stride


@dataclass(frozen=True)
class ForeignLayout:
    """An engine's KV blocks: see the module docstring."""

    spec: KVSpec
    num_blocks: int  # block ids 1 .. num_blocks - 1 hold KV (0 is the null block)
    block_bytes: int  # one block of one layer
    allocations: tuple[Allocation, ...]
    where: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)  # layer -> (alloc, index)
    host_offset: dict[int, int] = field(init=False, repr=False, compare=False)  # layer -> its run in a host page

    def __post_init__(self) -> None:
        spec = self.spec
        if spec.tp_size != 1:
            raise InvalidArgument("an engine-owned pool is one rank's: its spec has TP size 1 "
                                  "(name the shard in the spec's model or layout)")
        if not spec.layout:
            raise InvalidArgument("an engine-owned pool's spec names the engine's block layout (spec.layout)")
        if spec.state_bytes:
            raise InvalidArgument("engine-owned pools hold per-token KV only (no state layers yet)")
        _int("num_blocks", self.num_blocks, 2)
        if self.num_blocks - 1 > MAX_POOL_PAGES:
            raise InvalidArgument(f"at most {MAX_POOL_PAGES} blocks")
        _int("block_bytes", self.block_bytes, 1)
        if not self.allocations or len(self.allocations) > MAX_ALLOCATIONS:
            raise InvalidArgument(f"a pool has 1 to {MAX_ALLOCATIONS} allocations")
        where: dict[int, tuple[int, int]] = {}
        for a, alloc in enumerate(self.allocations):
            self._check_allocation(a, alloc, where)
        kv_layers = {i for i in range(spec.num_layers) if spec.page_bytes(i)}
        if set(where) != kv_layers:
            missing = sorted(kv_layers - set(where))
            raise InvalidArgument(f"every KV layer of the spec lies in exactly one allocation; missing: {missing}")
        object.__setattr__(self, "where", where)
        host: dict[int, int] = {}
        for segment in spec.host_page_layout():  # (in address order: a layer's first segment first)
            host.setdefault(segment.layer, segment.offset)
        object.__setattr__(self, "host_offset", host)

    def _check_allocation(self, a: int, alloc: Allocation, where: dict[int, tuple[int, int]]) -> None:
        name = f"allocation {a}"
        for field_name in ("size", "layer_stride", "block_stride", "offset"):
            _int(f"{name}.{field_name}", getattr(alloc, field_name))
        if not alloc.layers:
            raise InvalidArgument(f"{name} holds no layer")
        for i, layer in enumerate(alloc.layers):
            if type(layer) is not int or not 0 <= layer < self.spec.num_layers:
                raise InvalidArgument(f"{name}: layer {layer!r} is not a layer of the spec")
            if layer in where:
                raise InvalidArgument(f"layer {layer} appears twice")
            if self.spec.page_bytes(layer) != self.block_bytes:
                raise InvalidArgument(
                    f"{name}: a block of layer {layer} is {self.block_bytes} bytes, but one page of it is "
                    f"{self.spec.page_bytes(layer)} (page size x K and V bytes per token)")
            where[layer] = (a, i)
        blocks, layers, nbytes = self.num_blocks, len(alloc.layers), self.block_bytes
        # The two regular forms: layer-major (each layer's blocks one run: vLLM's) or
        # block-major (each block holds every layer). Anything else may overlap.
        layer_major = alloc.block_stride >= nbytes and (
            layers == 1 or alloc.layer_stride >= (blocks - 1) * alloc.block_stride + nbytes)
        block_major = alloc.layer_stride >= nbytes and (
            alloc.block_stride >= (layers - 1) * alloc.layer_stride + nbytes)
        if not (layer_major or block_major):
            raise InvalidArgument(f"{name}: blocks overlap (strides too small for {nbytes}-byte blocks)")
        end = alloc.offset + (layers - 1) * alloc.layer_stride + (blocks - 1) * alloc.block_stride + nbytes
        if end > alloc.size:
            raise InvalidArgument(f"{name}: its last block ends at byte {end}, past its size {alloc.size}")

    @property
    def num_pages(self) -> int:
        """Usable block ids: 1 .. num_pages."""
        return self.num_blocks - 1

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.to_dict(), "num_blocks": self.num_blocks, "block_bytes": self.block_bytes,
                "allocations": [a.to_dict() for a in self.allocations]}

    @classmethod
    def from_dict(cls, data: Any) -> "ForeignLayout":
        if not isinstance(data, dict) or set(data) != {"spec", "num_blocks", "block_bytes", "allocations"}:
            raise InvalidArgument("a foreign layout is a mapping of spec, num_blocks, block_bytes, allocations")
        allocations = data["allocations"]
        if not isinstance(allocations, list):
            raise InvalidArgument("allocations must be a list")
        out = []
        for item in allocations:
            if not isinstance(item, dict) or not {"size", "layers", "layer_stride", "block_stride"} <= set(item) \
                    or set(item) - {"size", "layers", "layer_stride", "block_stride", "offset"}:
                raise InvalidArgument("an allocation is a mapping of size, layers, layer_stride, block_stride, offset")
            if not isinstance(item["layers"], list):
                raise InvalidArgument("an allocation's layers must be a list")
            out.append(Allocation(item["size"], tuple(item["layers"]), item["layer_stride"], item["block_stride"],
                                  item.get("offset", 0)))
        return cls(KVSpec.from_dict(data["spec"]), data["num_blocks"], data["block_bytes"], tuple(out))

    def layer_segments(self, layer: int) -> tuple[int, Segments]:
        """Block -> host page copy of one layer: (its allocation, the one segment)."""
        a, i = self.where[layer]
        alloc = self.allocations[a]
        return a, Segments((alloc.layer_offset(i),), (alloc.block_stride,), (self.host_offset[layer],),
                           (self.spec.host_page_bytes,), (self.block_bytes,))

    def allocation_segments(self, a: int) -> Segments:
        """Block -> host page copy of every layer of allocation ``a``, in layer order."""
        parts = [self.layer_segments(layer)[1] for layer in self.allocations[a].layers]
        return Segments(*(tuple(v for part in parts for v in getattr(part, name)) for name in
                          ("src_offset", "src_stride", "dst_offset", "dst_stride", "nbytes")))


@dataclass(frozen=True)
class SharedMemory:
    """One allocation's memory as an engine hands it over: a ``memfd`` segment offered
    on the descriptor socket (named by ``token``; ``fd`` is the engine's own descriptor
    and never travels) or a CUDA allocation's ``cuda_ipc`` description."""

    kind: str
    nbytes: int
    token: bytes = b""
    cuda_ipc: dict[str, Any] | None = None
    fd: int = field(default=-1, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "nbytes": self.nbytes, "token": self.token, "cuda_ipc": self.cuda_ipc}


@dataclass(frozen=True)
class OwnedPoolHandle:
    """What an engine registers for an engine-owned pool: its layout, one buffer per
    allocation (in the layout's order), a name its other sessions attach by ("" for
    none), whether the pool has a KV event stream of its own (``kv_events``), and
    whether the tokens it serves and misses count in the daemon's token figures
    (``counts_tokens``: ``hicache_matched_tokens_total``, ``_missed_``, ``_load_short_``).
    A TP engine's ranks but the first register with both off: each rank's pool holds
    its shard of the same tokens, and the first rank's speaks for the engine — a router
    sees one stream per engine, and an operator each token once."""

    layout: ForeignLayout
    buffers: tuple[SharedMemory, ...]
    name: str = ""
    kv_events: bool = True
    counts_tokens: bool = True

    def __post_init__(self) -> None:
        if len(self.buffers) != len(self.layout.allocations):
            raise InvalidArgument(f"one buffer per allocation: {len(self.layout.allocations)} allocations, "
                                  f"{len(self.buffers)} buffers")
        for a, (buffer, alloc) in enumerate(zip(self.buffers, self.layout.allocations)):
            if buffer.nbytes != alloc.size:
                raise InvalidArgument(f"buffer {a} is {buffer.nbytes} bytes, its allocation {alloc.size}")
            if buffer.kind not in ("memfd", "cuda_ipc"):
                raise InvalidArgument(f"unknown buffer kind {buffer.kind!r}")
        if not isinstance(self.name, str) or len(self.name) > MAX_NAME:
            raise InvalidArgument(f"a pool name is a str of at most {MAX_NAME} characters")
        for flag in ("kv_events", "counts_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidArgument(f"{flag} is a bool, got {getattr(self, flag)!r}")


class ForeignPool:
    """The daemon's mapping of an engine-owned pool: one flat uint8 tensor per
    allocation. Quacks like a :class:`~hicache.pools.DevicePool` where the registry
    needs one (``spec``, ``num_pages``, ``device``, ``rank``, ``segment_id``, ``close``)."""

    rank = 0

    def __init__(self, layout: ForeignLayout, buffers: list[torch.Tensor], owners: list[Any]) -> None:
        if len(buffers) != len(layout.allocations):
            raise InvalidArgument("one buffer per allocation")
        devices = {b.device for b in buffers}
        if len(devices) != 1:
            raise InvalidArgument("every allocation of a pool lives on one device")
        for buffer, alloc in zip(buffers, layout.allocations):
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < alloc.size:
                raise InvalidArgument(f"an allocation's buffer must be a flat uint8 tensor of {alloc.size} bytes")
        self.layout = layout
        self.spec = layout.spec
        self.buffers = [b[: a.size] for b, a in zip(buffers, layout.allocations)]
        self._owners = owners
        self.segment_ids = [getattr(o, "segment_id", None) for o in owners]
        self.segment_id = tuple(self.segment_ids)

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    def close(self) -> None:
        self.buffers = []
        owners, self._owners = self._owners, []
        for owner in owners:
            if owner is not None:
                owner.close()


class ForeignMover:
    """Pages between a :class:`ForeignPool` and the host pool (the interface of
    :class:`~hicache.transfer.PageMover`: ``backup``, ``load`` with ``on_layer``,
    ``has_layer``, ``load_layer``)."""

    def __init__(self, pool: ForeignPool, host_pool: HostPool, *, max_programs: int = DEFAULT_MAX_PROGRAMS,
                 workers: CpuCopyWorkers | None = None) -> None:
        if pool.spec.fingerprint != host_pool.spec.fingerprint:
            raise SpecMismatch("the engine's pool and the host pool have different KV specs")
        self.pool = pool
        self.host_pool = host_pool
        self.max_programs = max_programs
        self.workers = workers
        layout = pool.layout
        self.num_layers = pool.spec.num_layers
        self._backup = [layout.allocation_segments(a) for a in range(len(layout.allocations))]
        self._restore_layer = {layer: (a, seg.reversed()) for layer in layout.where
                               for a, seg in (layout.layer_segments(layer),)}
        # On the CPU the copies take the reference path: its views of the host pool and
        # of each allocation — per layer for a load, all of them for a store — are built
        # here once, not for every layer of every copy. A pool's allocations stay where
        # they are while it is registered (an engine that registers again gets a new
        # pool, and a new mover).
        self._layer_plans = self._backup_plan = None
        if pool.device.type == "cpu":
            self._layer_plans = {layer: ReferencePlan([(host_pool.pages, pool.buffers[a], segments)])
                                 for layer, (a, segments) in self._restore_layer.items()}
            self._backup_plan = ReferencePlan([(buffer, host_pool.pages, segments)
                                               for buffer, segments in zip(pool.buffers, self._backup)])

    @property
    def bytes_per_page(self) -> int:
        return sum(s.bytes_per_pair for s in self._backup)

    def _ids(self, pages) -> torch.Tensor:
        ids = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).cpu()
        return ids

    def _run(self, src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
             segments: Segments, plan: ReferencePlan | None, *, spread: bool = True) -> None:
        """Copy ``src_ids`` -> ``dst_ids`` (the caller checked them)."""
        workers = self.workers if spread else None
        if plan is not None:
            plan.run(page_runs(src_ids, dst_ids), workers)
            return
        src_ids, dst_ids = ids_on(self.pool.device, src_ids), ids_on(self.pool.device, dst_ids)
        copy_pages(src, dst, src_ids, dst_ids, segments, max_programs=self.max_programs, workers=workers,
                   check=False)

    def backup(self, blocks, host_pages) -> None:
        """Engine blocks -> host pages, every layer: ``host_pages[i]`` receives ``blocks[i]``.
        On the CPU the pages' runs are found once and move through every allocation."""
        src, dst = self._ids(blocks), self._ids(host_pages)
        for a, segments in enumerate(self._backup):
            check_page_ids(src, dst, segments, self.pool.buffers[a].numel(), self.host_pool.pages.numel(),
                           num_src_pages=self.pool.layout.num_blocks, num_dst_pages=self.host_pool.num_pages)
        if self._backup_plan is not None:
            self._backup_plan.run(page_runs(src, dst), self.workers)
            return
        for a, segments in enumerate(self._backup):
            self._run(self.pool.buffers[a], self.host_pool.pages, src, dst, segments, None)

    def has_layer(self, layer: int) -> bool:
        return layer in self._restore_layer

    def load_layer(self, host_pages, blocks, layer: int, *, check: bool = True, spread: bool = True) -> None:
        a, segments = self._restore_layer[layer]
        plan = self._layer_plans[layer] if self._layer_plans is not None else None
        src, dst = self._ids(host_pages), self._ids(blocks)
        if check:  # (against the pool's blocks too: past a layer's last lies the next layer's first)
            check_page_ids(src, dst, segments, self.host_pool.pages.numel(), self.pool.buffers[a].numel(),
                           num_src_pages=self.host_pool.num_pages, num_dst_pages=self.pool.layout.num_blocks)
        self._run(self.host_pool.pages, self.pool.buffers[a], src, dst, segments, plan, spread=spread)

    def load(self, host_pages, blocks, *, on_layer: Callable[[int], None] | None = None,
             proceed: Callable[[], None] | None = None) -> None:
        """Host pages -> engine blocks layer by layer; ``on_layer(i)`` once layer ``i``
        is complete (every layer of the spec, in order), ``proceed()`` before each layer
        (see :mod:`hicache.transfer`). With CPU workers, each thread takes a share of the
        pages through every layer (as :class:`PageMover` does)."""
        src, dst = self._ids(host_pages), self._ids(blocks)
        for a, segments in enumerate(self._backup):  # every layer's pages checked once, up front
            check_page_ids(src, dst, segments.reversed(), self.host_pool.pages.numel(), self.pool.buffers[a].numel(),
                           num_src_pages=self.host_pool.num_pages, num_dst_pages=self.pool.layout.num_blocks)
        if self.workers is None or self.pool.device.type != "cpu" or len(src) < 2:
            self._layers(src, dst, on_layer, proceed)
            return
        spread_layers(self.workers, self.num_layers, len(src), self.bytes_per_page, on_layer,
                      lambda lo, hi, done: self._layers(src[lo:hi], dst[lo:hi], done, proceed))

    def _layers(self, src: torch.Tensor, dst: torch.Tensor, on_layer: Callable[[int], None] | None,
                proceed: Callable[[], None] | None) -> None:
        copy_layer = self._layer_copy(src, dst)
        for layer in range(self.num_layers):
            if proceed is not None:
                proceed()
            copy_layer(layer)
            if on_layer is not None:
                on_layer(layer)

    def _layer_copy(self, src: torch.Tensor, dst: torch.Tensor) -> Callable[[int], None]:
        """One layer's copy of these (checked) pages: on the CPU through the layer's
        plan, the pages' runs found once for all the layers."""
        if self._layer_plans is not None:
            return planned_layers(self._layer_plans, src, dst)

        def enqueue(layer: int) -> None:
            if layer in self._restore_layer:
                # (already on a worker thread: no nested hand-off to the same threads)
                self.load_layer(src, dst, layer, check=False, spread=False)

        return enqueue
