"""Moving pages between one rank's device pool and the host pool.

:class:`PageMover` precomputes the copy-kernel segment tables of a (device pool, host
pool) pair once — all layers device -> host, each layer host -> device, state slots
both ways; for a CPU pool, each layer's views of the two buffers too — and runs them
with :func:`hicache.kernels.page_copy.copy_pages` (Triton on CUDA, the torch path on
the CPU, spread over ``workers`` threads when given). Page ids
are checked on the host before they go to the device, so no call synchronises. Calls
are synchronous on the CPU and enqueue on the current stream on CUDA; a layer-wise load
calls ``on_layer(i)`` right after layer *i*'s copies are done (CPU) or enqueued (CUDA),
which is where a caller stamps the layer counter or records the layer's CUDA event, and
``proceed()``, if given, before it starts each layer's copies, on every copying thread:
a load whose ``proceed`` raises (and goes on raising: a deadline) copies no layer after
that, on any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from hicache.errors import InvalidArgument, SpecMismatch
from hicache.kernels.copy_plan import CpuCopyWorkers, check_page_ids
from hicache.kernels.page_copy import DEFAULT_MAX_PROGRAMS, ReferencePlan, copy_pages, page_runs
from hicache.pools import (
    DevicePool,
    HostPool,
    device_state_segments,
    layer_segment_ranges,
    page_segments,
    state_segments,
)

PageList = Sequence[int] | torch.Tensor


def ids_on(device: torch.device, pages: PageList) -> torch.Tensor:
    """Page ids as an int64 tensor on ``device`` (moved there without a sync)."""
    ids = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
    if device.type == "cuda" and ids.device.type == "cpu":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return ids


def spread_layers(workers: CpuCopyWorkers, num_layers: int, num_pages: int, page_bytes: int,
                  on_layer: Callable[[int], None] | None,
                  run: Callable[[int, int, Callable[[int], None]], None]) -> None:
    """A layer-by-layer load spread over CPU copy threads: each thread takes a share of
    the pages (``run(lo, hi, layer_done)``) through every layer without waiting for the
    others; a layer is reported (``on_layer``) by whichever thread finishes it last, and
    since every thread goes through the layers in order, the reports come in order too.
    A load too small to be worth a second thread (:meth:`CpuCopyWorkers.parts`) runs
    here, on the calling thread alone."""
    parts = workers.parts(num_pages * page_bytes, num_pages)
    if parts < 2:
        run(0, num_pages, on_layer or (lambda layer: None))
        return
    bounds = [num_pages * i // parts for i in range(parts + 1)]
    remaining = [parts] * num_layers
    lock = threading.Lock()

    def layer_done(layer: int) -> None:
        with lock:
            remaining[layer] -= 1
            last = remaining[layer] == 0
        if last and on_layer is not None:
            on_layer(layer)

    workers.run(lambda part: run(part[0], part[1], layer_done), [(bounds[i], bounds[i + 1]) for i in range(parts)])


def planned_layers(plans: Mapping[int, ReferencePlan], src_ids: torch.Tensor,
                   dst_ids: torch.Tensor) -> Callable[[int], None]:
    """One layer's copy of these (checked) pages through its plan (none: nothing to
    copy). The pages' runs are found here, once for all the layers: per layer, a load
    does nothing but copy."""
    runs = page_runs(src_ids, dst_ids)

    def move(layer: int) -> None:
        plan = plans.get(layer)
        if plan is not None:
            plan.move(runs)

    return move


class PageMover:
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *,
                 max_programs: int = DEFAULT_MAX_PROGRAMS, workers: CpuCopyWorkers | None = None) -> None:
        if device_pool.spec.fingerprint != host_pool.spec.fingerprint:
            raise SpecMismatch("device pool and host pool have different KV specs")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.max_programs = max_programs
        self.workers = workers
        layout = device_pool.layout
        self._backup = page_segments(layout, device_pool.rank)
        spec = device_pool.spec
        kept = [i for i, r in enumerate(layout.token_regions) if not spec.is_swa(r.layer)]
        # A page whose SWA part is dropped (hicache.tiers.windows): the other layers only.
        self._backup_kept = self._backup.select(kept) if kept else None
        swa = [i for i, r in enumerate(layout.token_regions) if spec.is_swa(r.layer)]
        self._backup_swa = self._backup.select(swa) if swa else None  # (the SWA layers only)
        restore = self._backup.reversed()
        self._restore = restore
        self._restore_layer = {layer: restore.select(r) for layer, r in layer_segment_ranges(layout).items()}
        # A CPU pool's layer copies take the reference path: its views of the two
        # buffers, per layer, are built here once rather than for every layer of a load.
        self._layer_plans = None if device_pool.device.type != "cpu" else {
            layer: ReferencePlan([(host_pool.pages, device_pool.buffer, segments)])
            for layer, segments in self._restore_layer.items()}
        self._states = state_segments(layout, device_pool.rank) if layout.state_regions else None
        self._device_states = device_state_segments(layout) if layout.state_regions else None
        self.num_layers = device_pool.spec.num_layers
        # The ids each buffer holds, which a copy's ids are checked against besides its
        # bytes: past a region's last page lie its padding and the next region.
        self._num_device_pages = layout.num_pages + 1  # (page 0: padding)
        self._num_device_slots = layout.num_state_slots + layout.checkpoint_slots + 1  # (slot 0: padding)

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page moves for this rank (all layers)."""
        return self._backup.bytes_per_pair

    def _ids(self, pages: PageList) -> torch.Tensor:
        return ids_on(self.device_pool.device, pages)

    def _copy(self, src, dst, src_pages, dst_pages, segments, num_src: int, num_dst: int) -> None:
        src_ids, dst_ids = self._checked(src_pages, dst_pages, src, dst, segments, num_src, num_dst)
        copy_pages(src, dst, src_ids, dst_ids, segments, max_programs=self.max_programs,
                   workers=self.workers, check=False)

    def _checked(self, src_pages, dst_pages, src, dst, segments, num_src: int,
                 num_dst: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Check page ids on the host (no device sync) against the ``num_src`` /
        ``num_dst`` ids of the two buffers, then move them to the device."""
        host_src = torch.as_tensor(src_pages, dtype=torch.int64).reshape(-1).cpu()
        host_dst = torch.as_tensor(dst_pages, dtype=torch.int64).reshape(-1).cpu()
        check_page_ids(host_src, host_dst, segments, src.numel(), dst.numel(), num_src_pages=num_src,
                       num_dst_pages=num_dst)
        return self._ids(host_src), self._ids(host_dst)

    def backup(self, device_pages: PageList, host_pages: PageList, *, without_swa: bool = False,
               only_swa: bool = False) -> None:
        """Device -> host, every layer: ``host_pages[i]`` receives ``device_pages[i]``
        (``without_swa``: all but the SWA layers' segments; ``only_swa``: those only)."""
        segments = self._backup_kept if without_swa else self._backup_swa if only_swa else self._backup
        if segments is not None:
            self._copy(self.device_pool.buffer, self.host_pool.pages, device_pages, host_pages, segments,
                       self._num_device_pages, self.host_pool.num_pages)

    def load(self, host_pages: PageList, device_pages: PageList, *,
             on_layer: Callable[[int], None] | None = None,
             proceed: Callable[[], None] | None = None) -> None:
        """Host -> device layer by layer; ``on_layer(i)`` once layer ``i`` is complete
        (every layer of the spec is reported, state layers included, in order);
        ``proceed()`` before each layer (see the module docstring).

        With CPU ``workers``, the pages are spread over them (:func:`spread_layers`).
        """
        host_ids, device_ids = self._checked(host_pages, device_pages, self.host_pool.pages,
                                             self.device_pool.buffer, self._restore, self.host_pool.num_pages,
                                             self._num_device_pages)
        if self.workers is None or self.device_pool.device.type != "cpu" or len(host_ids) < 2:
            self._load_layers(host_ids, device_ids, on_layer, proceed)
            return
        spread_layers(self.workers, self.num_layers, len(host_ids), self.bytes_per_page, on_layer,
                      lambda lo, hi, done: self._load_layers(host_ids[lo:hi], device_ids[lo:hi], done, proceed))

    def _load_layers(self, host_ids: torch.Tensor, device_ids: torch.Tensor,
                     on_layer: Callable[[int], None] | None, proceed: Callable[[], None] | None) -> None:
        copy_layer = self._layer_copy(host_ids, device_ids)
        for layer in range(self.num_layers):
            if proceed is not None:
                proceed()
            copy_layer(layer)
            if on_layer is not None:
                on_layer(layer)

    def _layer_copy(self, host_ids: torch.Tensor, device_ids: torch.Tensor) -> Callable[[int], None]:
        """One layer's copy of these (checked) pages. On the CPU the pages' runs are
        found once for all the layers, and each layer only moves them: per layer, a
        load does nothing but copy (a 32-layer load redid each layer's runs and views)."""
        if self._layer_plans is not None:
            return planned_layers(self._layer_plans, host_ids, device_ids)

        def enqueue(layer: int) -> None:
            segments = self._restore_layer.get(layer)
            if segments is not None:
                copy_pages(self.host_pool.pages, self.device_pool.buffer, host_ids, device_ids, segments,
                           max_programs=self.max_programs, check=False)

        return enqueue

    def load_all(self, host_pages: PageList, device_pages: PageList) -> None:
        """Host -> device, every layer in one copy (no per-layer completion)."""
        self._copy(self.host_pool.pages, self.device_pool.buffer, host_pages, device_pages, self._restore,
                   self.host_pool.num_pages, self._num_device_pages)

    def has_layer(self, layer: int) -> bool:
        """Does ``layer`` have per-token KV to move?"""
        return layer in self._restore_layer

    def load_layer(self, host_pages: PageList, device_pages: PageList, layer: int) -> None:
        segments = self._restore_layer.get(layer)
        if segments is None:
            raise InvalidArgument(f"layer {layer} has no per-token KV")
        self._copy(self.host_pool.pages, self.device_pool.buffer, host_pages, device_pages, segments,
                   self.host_pool.num_pages, self._num_device_pages)

    def backup_states(self, device_slots: PageList, host_slots: PageList) -> None:
        """Recurrent-state slots, device -> host (every state layer)."""
        self._copy(self.device_pool.buffer, self.host_pool.states, device_slots, host_slots, self._state_segments(),
                   self._num_device_slots, self.host_pool.num_state_slots)

    def load_states(self, host_slots: PageList, device_slots: PageList) -> None:
        self._copy(self.host_pool.states, self.device_pool.buffer, host_slots, device_slots,
                   self._state_segments().reversed(), self.host_pool.num_state_slots, self._num_device_slots)

    def copy_states(self, src_slots: PageList, dst_slots: PageList) -> None:
        """Recurrent-state slots to other slots of the same pool (every state layer)."""
        if self._device_states is None:
            raise InvalidArgument("this pool has no state layers")
        buffer = self.device_pool.buffer
        self._copy(buffer, buffer, src_slots, dst_slots, self._device_states, self._num_device_slots,
                   self._num_device_slots)

    def _state_segments(self):
        if self._states is None or not self.host_pool.num_state_slots:
            raise InvalidArgument("no state slots on one side of this mover")
        return self._states
