"""KV pools: the engine's device pool as the daemon sees it, and the daemon's host pool.

Device pool (one per engine rank), one flat buffer laid out region after region, every
region aligned to 256 bytes; token regions have one padding page (page 0) in front, as
in SGLang's pools (``size + page_size`` slots), state regions one padding slot::

    | L0.k [(P+1)*ps, heads, head_dim] | L0.v [...] | L1.k | ... | S0.conv [(R+1), ...] | S0.temporal | ...

For MLA the token region of a layer is one ``kv`` buffer ``[(P+1)*ps, 1, rank+rope]``;
fp8 is stored as uint8. A token slot is ``page * page_size + offset``, so device page
``p`` of a region is the ``p``-th run of ``page_bytes`` bytes of that region.

The engine creates the buffer (:func:`hicache.engine.kv_pool.export_kv_pool`) in a sealed
memfd segment (CPU mode, :mod:`hicache.shm`) that it hands over as a descriptor, or in
CUDA memory it exports with an IPC handle, and sends a :class:`PoolHandle`; the daemon
maps it with :meth:`DevicePool.attach`.

Host pool, page-first: host page ``h`` is ``host_page_bytes`` contiguous bytes holding
that page for every rank and layer (:meth:`hicache.spec.KVSpec.host_page_layout`), so one
host page is one disk record as is. Recurrent-state slots follow the pages region, one
``tp_size * state_bytes`` record per slot. On CUDA machines the buffer is page-locked
(``cudaHostRegister`` in chunks, unregistered on close). Either way it is private
anonymous memory: no other process can map it.

:func:`page_segments` and :func:`state_segments` describe, for the copy kernels, which
bytes of a device pool go where in a host page or host state slot.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache.errors import InvalidArgument, SpecMismatch
from hicache.kernels.copy_plan import Segments
from hicache.spec import KVSpec, torch_dtype

ALIGN_BYTES = 256
PIN_CHUNK_BYTES = 1 << 30
MAX_POOL_PAGES = 1 << 31  # page ids are int32


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class Region:
    """One tensor of a device pool: a layer's token component or state component."""

    layer: int
    component: str
    offset: int  # bytes from the start of the buffer
    shape: tuple[int, ...]  # whole tensor, padding page / slot included
    dtype: str  # logical dtype (fp8 is stored as uint8)
    unit_bytes: int  # bytes of one page (token regions) or one slot (state regions)
    nbytes: int  # the whole tensor


@dataclass(frozen=True)
class DeviceLayout:
    """Where every region of one rank's device pool lives in its flat buffer."""

    spec: KVSpec
    num_pages: int
    num_state_slots: int
    token_regions: tuple[Region, ...]
    state_regions: tuple[Region, ...]
    nbytes: int
    # State slots after the engine's, lent to hicache for checkpoints on the device
    # (slots num_state_slots + 1 .. num_state_slots + checkpoint_slots).
    checkpoint_slots: int = 0

    @classmethod
    def build(cls, spec: KVSpec, num_pages: int, num_state_slots: int = 0,
              checkpoint_slots: int = 0) -> "DeviceLayout":
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise InvalidArgument(f"num_pages must be a positive int, got {num_pages!r}")
        for name, value in (("num_state_slots", num_state_slots), ("checkpoint_slots", checkpoint_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"{name} must be a non-negative int, got {value!r}")
        if spec.state_bytes and not num_state_slots:
            raise InvalidArgument("this spec has state layers: num_state_slots must be positive")
        if checkpoint_slots and not spec.state_bytes:
            raise InvalidArgument("checkpoint_slots are for specs with state layers")
        num_slots = (num_pages + 1) * spec.page_size
        offset = 0
        token_regions = []
        state_regions = []
        for index, layer in enumerate(spec.layers):
            for comp in layer.token_components:
                nbytes = num_slots * comp.nbytes
                token_regions.append(Region(index, comp.name, offset, (num_slots, *comp.shape), comp.dtype,
                                            spec.page_size * comp.nbytes, nbytes))
                offset = _align(offset + nbytes)
        slots = num_state_slots + checkpoint_slots + 1  # (slot 0: padding)
        for index, layer in enumerate(spec.layers):
            for comp in layer.state_components:
                nbytes = slots * comp.nbytes
                state_regions.append(Region(index, comp.name, offset, (slots, *comp.shape),
                                            comp.dtype, comp.nbytes, nbytes))
                offset = _align(offset + nbytes)
        return cls(spec, num_pages, num_state_slots, tuple(token_regions), tuple(state_regions), offset,
                   checkpoint_slots)

    def to_dict(self) -> dict[str, Any]:
        out = {"spec": self.spec.to_dict(), "num_pages": self.num_pages, "num_state_slots": self.num_state_slots}
        if self.checkpoint_slots:
            out["checkpoint_slots"] = self.checkpoint_slots
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "DeviceLayout":
        if not isinstance(data, dict) or set(data) - {"spec", "num_pages", "num_state_slots", "checkpoint_slots"}:
            raise InvalidArgument("a pool layout is a mapping of spec, num_pages, num_state_slots, checkpoint_slots")
        num_pages, num_state_slots = data.get("num_pages"), data.get("num_state_slots", 0)
        checkpoint_slots = data.get("checkpoint_slots", 0)
        for name, value in (("num_pages", num_pages), ("num_state_slots", num_state_slots),
                            ("checkpoint_slots", checkpoint_slots)):
            if type(value) is not int or not 0 <= value <= MAX_POOL_PAGES:
                raise InvalidArgument(f"layout.{name} must be an int in [0, {MAX_POOL_PAGES}]")
        return cls.build(KVSpec.from_dict(data.get("spec")), num_pages, num_state_slots, checkpoint_slots)


def page_segments(layout: DeviceLayout, rank: int = 0) -> Segments:
    """Device -> host copy of one page, every layer, for ``rank``'s pool (in layer order)."""
    spec = layout.spec
    if not 0 <= rank < spec.tp_size:
        raise InvalidArgument(f"rank {rank} outside TP size {spec.tp_size}")
    host = {(s.rank, s.layer, s.component): s for s in spec.host_page_layout()}
    rows = []
    for region in layout.token_regions:
        seg = host[(rank, region.layer, region.component)]
        assert seg.nbytes == region.unit_bytes
        rows.append((region.offset, region.unit_bytes, seg.offset, spec.host_page_bytes, seg.nbytes))
    return Segments(*map(tuple, zip(*rows)))


def layer_segment_ranges(layout: DeviceLayout) -> dict[int, range]:
    """For each layer with token KV, the indices of its segments in :func:`page_segments`."""
    ranges: dict[int, range] = {}
    for i, region in enumerate(layout.token_regions):
        first = ranges.get(region.layer)
        ranges[region.layer] = range(first.start if first else i, i + 1)
    return ranges


def device_state_segments(layout: DeviceLayout) -> Segments:
    """A recurrent-state slot to another slot of the same pool, every state layer."""
    if not layout.state_regions:
        raise InvalidArgument("this pool has no state layers")
    rows = [(r.offset, r.unit_bytes, r.offset, r.unit_bytes, r.unit_bytes) for r in layout.state_regions]
    return Segments(*map(tuple, zip(*rows)))


def state_segments(layout: DeviceLayout, rank: int = 0) -> Segments:
    """Device -> host copy of one request's recurrent state, every state layer."""
    spec = layout.spec
    if not layout.state_regions:
        raise InvalidArgument("this pool has no state layers")
    record = spec.tp_size * spec.state_bytes
    rows = []
    offset = rank * spec.state_bytes
    for region in layout.state_regions:
        rows.append((region.offset, region.unit_bytes, offset, record, region.unit_bytes))
        offset += region.unit_bytes
    return Segments(*map(tuple, zip(*rows)))


@dataclass(frozen=True)
class PoolHandle:
    """What an engine sends the daemon so that it can map one rank's device pool.

    ``kind`` is ``"memfd"`` (CPU: a sealed memfd segment handed over on the
    descriptor socket, named by ``token``) or ``"cuda_ipc"``. ``fd`` is the segment's
    descriptor in the engine's own process: it never travels (``to_dict`` leaves it
    out, ``from_dict`` never sets it)."""

    kind: str
    layout: dict[str, Any]  # DeviceLayout.to_dict()
    nbytes: int
    rank: int = 0
    token: bytes = b""
    cuda_ipc: dict[str, Any] | None = None
    fd: int = field(default=-1, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "layout": self.layout, "nbytes": self.nbytes, "rank": self.rank,
            "token": self.token, "cuda_ipc": self.cuda_ipc,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "PoolHandle":
        """A handle from the wire, every field checked for its type."""
        if not isinstance(data, dict):
            raise InvalidArgument(f"a pool handle is a mapping, got {type(data).__name__}")
        types = {"kind": str, "layout": dict, "nbytes": int, "rank": int, "token": bytes,
                 "cuda_ipc": (dict, type(None))}
        unknown = [k for k in data if k not in types]
        if unknown:
            raise InvalidArgument(f"bad pool handle: unknown fields {sorted(map(str, unknown))}")
        for name in ("kind", "layout", "nbytes"):
            if name not in data:
                raise InvalidArgument(f"bad pool handle: no {name!r}")
        for name, value in data.items():
            if not isinstance(value, types[name]) or isinstance(value, bool):
                raise InvalidArgument(f"bad pool handle: {name} has type {type(value).__name__}")
        return cls(**data)


class DevicePool:
    """Typed views over one rank's device pool buffer (engine side or daemon side)."""

    def __init__(self, layout: DeviceLayout, buffer: torch.Tensor, *, rank: int = 0, owner: Any = None) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < layout.nbytes:
            raise InvalidArgument(f"pool buffer must be a flat uint8 tensor of at least {layout.nbytes} bytes")
        self.layout = layout
        self.spec = layout.spec
        self.rank = rank
        self.buffer = buffer[: layout.nbytes]
        self._owner = owner  # keeps the shared memory / IPC mapping alive
        # What tells this pool's memory from another's (a memfd's device and inode, a
        # CUDA allocation's IPC handle): one memory is never registered as two pools.
        self.segment_id: Any = getattr(owner, "segment_id", None)
        self._views = {(r.layer, r.component): self._view(r) for r in (*layout.token_regions, *layout.state_regions)}

    def _view(self, region: Region) -> torch.Tensor:
        flat = self.buffer[region.offset : region.offset + region.nbytes]
        return flat.view(torch_dtype(region.dtype)).view(region.shape)

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def buffer_of(self, layer: int, component: str) -> torch.Tensor:
        """The tensor of one layer component (``k``, ``v``, ``kv``, ``conv``, ``temporal``)."""
        try:
            return self._views[(layer, component)]
        except KeyError:
            raise InvalidArgument(f"layer {layer} has no component {component!r}") from None

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer_of(layer, "k")

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer_of(layer, "v")

    def kv_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer_of(layer, "kv")

    @classmethod
    def attach(cls, handle: PoolHandle, *, expected: KVSpec | None = None,
               segment: Callable[[PoolHandle], Any] | None = None,
               cuda: Callable[[PoolHandle], torch.Tensor] | None = None) -> "DevicePool":
        """Map a pool an engine exported (daemon side). ``segment(handle)`` maps a
        ``memfd`` handle's segment and returns its owner: an object with ``tensor``
        and ``close()`` (the daemon's checks of who offered it live there).
        ``cuda(handle)`` opens a ``cuda_ipc`` handle's memory (the daemon's: as the
        registering user's); by default, as this process's user's."""
        layout = DeviceLayout.from_dict(handle.layout)
        if expected is not None and layout.spec.fingerprint != expected.fingerprint:
            raise SpecMismatch("the pool's KV spec differs from the registered one")
        if handle.nbytes != layout.nbytes:
            raise InvalidArgument(f"handle says {handle.nbytes} bytes, the layout needs {layout.nbytes}")
        if not 0 <= handle.rank < layout.spec.tp_size:
            raise InvalidArgument(f"rank {handle.rank} outside TP size {layout.spec.tp_size}")
        if handle.kind == "memfd":
            if segment is None:
                raise InvalidArgument("memfd pools are mapped from a descriptor the engine offered")
            owner = segment(handle)
            try:
                return cls(layout, owner.tensor, rank=handle.rank, owner=owner)
            except BaseException:
                owner.close()
                raise
        if handle.kind == "cuda_ipc":
            from hicache.cuda_ipc import open_tensor, segment_id

            if cuda is None:
                tensor = open_tensor(handle.cuda_ipc, handle.nbytes, uid=os.getuid())
            else:
                tensor = cuda(handle)
            pool = cls(layout, tensor, rank=handle.rank)
            pool.segment_id = segment_id(handle.cuda_ipc)
            return pool
        raise InvalidArgument(f"unknown pool handle kind {handle.kind!r}")

    def close(self) -> None:
        self._views.clear()
        self.buffer = None  # type: ignore[assignment]
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.close()


class HostPool:
    """The daemon's host pool: ``num_pages`` page-first host pages (+ state slots)."""

    def __init__(self, spec: KVSpec, num_pages: int, *, num_state_slots: int = 0, pinned: bool | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        """``progress(bytes pinned so far)`` is called after each chunk is pinned (a
        large pool takes seconds: a caller on an event loop feeds its watchdog)."""
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise InvalidArgument(f"num_pages must be a positive int, got {num_pages!r}")
        if num_state_slots < 0:
            raise InvalidArgument(f"num_state_slots must be non-negative, got {num_state_slots}")
        self.spec = spec
        self.num_pages = num_pages
        self.num_state_slots = num_state_slots
        self.page_bytes = spec.host_page_bytes
        self.state_slot_bytes = spec.tp_size * spec.state_bytes
        self.pages_nbytes = num_pages * self.page_bytes
        self.nbytes = self.pages_nbytes + num_state_slots * self.state_slot_bytes
        if pinned is None:
            pinned = torch.cuda.is_available()
        self.pinned = pinned
        self._registered: list[int] = []
        # Private anonymous memory: no process but the daemon maps it, and nothing of
        # it survives the daemon.
        self._map: mmap.mmap | None = mmap.mmap(-1, self.nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        if pinned:
            self._register(progress)
        self.pages = self.buffer[: self.pages_nbytes]
        self.states = self.buffer[self.pages_nbytes :]
        self._pages_array = self.pages.numpy()  # (see page_array)

    @staticmethod
    def num_pages_for(spec: KVSpec, *, nbytes: int | None = None, ratio: float | None = None,
                      device_pages: int | None = None) -> int:
        """Host pages for a size in bytes, or for ``ratio`` times a device pool of
        ``device_pages`` pages (a TP group's pool: every rank's shard of a page)."""
        if (nbytes is None) == (ratio is None):
            raise InvalidArgument("size the host pool by nbytes or by ratio, not both")
        if nbytes is not None:
            pages = nbytes // spec.host_page_bytes
        else:
            if device_pages is None or ratio <= 0:
                raise InvalidArgument("a ratio needs device_pages and must be positive")
            pages = int(device_pages * ratio)
        if pages <= 0:
            raise InvalidArgument("the host pool would hold no page")
        return pages

    def page(self, host_page: int) -> torch.Tensor:
        """The bytes of one host page (what a disk record holds)."""
        return self.pages[self._span(host_page)]

    def _span(self, host_page: int) -> slice:
        if not 0 <= host_page < self.num_pages:
            raise InvalidArgument(f"host page {host_page} outside [0, {self.num_pages})")
        return slice(host_page * self.page_bytes, (host_page + 1) * self.page_bytes)

    def page_array(self, host_page: int) -> np.ndarray:
        """:meth:`page` as a numpy view. A tensor is an object the cyclic garbage collector
        tracks, a numpy view is not: the disk writer's queue may hold a view of every
        page being written, and every full collection walked them all (10 ms then
        163 ms a collection as a backlog of 15,000 pages built up)."""
        return self._pages_array[self._span(host_page)]

    def pages_array(self) -> np.ndarray:
        """Every page as one row of a 2-D numpy view (the disk writer reads its rows)."""
        return self._pages_array.reshape(self.num_pages, self.page_bytes)

    def _register(self, progress: Callable[[int], None] | None) -> None:
        cudart = torch.cuda.cudart()
        base = self.buffer.data_ptr()
        # cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context and
        # mapped into the device address space, so kernels read it through UVA.
        flags = 0x01 | 0x02
        for start in range(0, self.nbytes, PIN_CHUNK_BYTES):
            size = min(PIN_CHUNK_BYTES, self.nbytes - start)
            err = cudart.cudaHostRegister(base + start, size, flags)
            if int(err) != 0:
                self._unregister()
                raise RuntimeError(f"cudaHostRegister failed with error {int(err)} (is LimitMEMLOCK high enough?)")
            self._registered.append(base + start)
            if progress is not None:
                progress(start + size)

    def _unregister(self) -> None:
        cudart = torch.cuda.cudart()
        while self._registered:
            cudart.cudaHostUnregister(self._registered.pop())

    def close(self) -> None:
        self.pages = self.states = self.buffer = self._pages_array = None  # type: ignore[assignment]
        if self.pinned:
            self._unregister()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view still holds it: unmapped when the last view goes
            self._map = None
