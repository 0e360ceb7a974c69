"""Page-copy benchmark: device -> host gather and host -> device scatter vs ``copy_``.

A 32-layer MHA spec (8 KV heads x 128, fp16, page size 16: 64 KiB per layer-page,
2 MiB per host page). On a CPU machine the "device" pool is the engine's shared-memory
pool and the copies take the torch path of hicache.kernels.page_copy; with CUDA the
device pool is on the GPU, the host pool pinned, and the copies run the Triton kernel.

For each direction it moves ``--pages`` pages between random, unsorted page ids (and,
separately, between contiguous runs), and compares with a plain ``copy_`` of the same
number of bytes between two preallocated contiguous buffers on the same devices. Each
figure is the best of ``--repeat`` rounds, every variant run once per round.

Time to first layer: a layer-wise host -> device load of the random pages, started the
way the tier manager starts one (:func:`hicache.tiers.loads.copy_layers` on the pool's
copy engine, each layer stamped on the pool's layer counters, CUDA events recorded on
a GPU), and waited for by an engine process through a :class:`LayerWaiter`: the time
from the load's start until layer 0 has landed for the engine (on a GPU: its stream has
passed the wait on the layer's event), and until every layer has. Next to it, the
whole-load ``copy_`` of the same bytes host -> device (the ``copy_`` floor above), which
an engine loading without per-layer completion waits for before it computes anything;
ideally the first layer takes ``1 / num_layers`` of that.

Engine-owned pool: the same pages between the host pool and a pool the engine
allocated in its own layout, as vLLM's connector registers one (vLLM's GPU layout: one
allocation per layer, each block of it one run of that layer's K and V), moved by a
:class:`~hicache.foreign.ForeignMover` over the same copy threads: a layer-wise load of
the random pages into random blocks (``load_into``) and a store of the same blocks
(every layer, block -> host page), against the same ``copy_`` floor.

    python benchmarks/bench_copy.py [--pages 256] [--json]

With ``--json`` the last line is one JSON object: ``gather_gbps``, ``scatter_gbps``,
``copy_gbps``, ``gather_ratio``, ``scatter_ratio``, the layer-wise and contiguous
variants, ``foreign_layerwise_scatter_gbps`` / ``_ratio`` and ``foreign_gather_gbps`` /
``_ratio`` (the engine-owned pool), and ``first_layer_ms``, ``all_layers_ms``,
``whole_copy_ms`` with ``first_layer_ratio`` and ``all_layers_ratio`` (each over
``whole_copy_ms``), and ``enqueue_ms``: how long starting the load kept the caller's
thread (the daemon's loop) busy — handing it to the copy engine (on a GPU its own
enqueuing thread launches the layers' copies; until 1ae1d17 the caller did).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.reduction
import os
import sys
import time
import traceback

import numpy as np
import torch

from hicache.counters import CountersHandle, LayerWaiter, Ticket
from hicache.engine.kv_pool import export_kv_pool
from hicache.foreign import Allocation, ForeignLayout, ForeignMover, ForeignPool
from hicache.jobs import Completions, Workers
from hicache.kernels.copy_plan import CpuCopyWorkers
from hicache.pools import DevicePool, HostPool
from hicache.spec import KVSpec
from hicache.tiers.copying import CopyEngines
from hicache.tiers.devices import DevicePools
from hicache.tiers.loads import copy_layers
from hicache.tiers.transfers import Entry, Kind, Transfer
from hicache.transfer import PageMover
from hicache.tree import HiRadixTree, PoolId

WAIT_S = 120.0  # a load or an answer of the engine process later than this fails the run


def now() -> float:
    """CLOCK_MONOTONIC: one clock in both processes (``perf_counter`` promises none)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def best_seconds(fns: dict, repeat: int, sync) -> dict[str, float]:
    """Best time of each function over ``repeat`` rounds, the functions interleaved
    within each round so that a slow spell of the machine hits all of them alike. A
    function that times parts of its run itself returns them (a dict, name -> seconds):
    the best of each part is kept under that part's name."""
    best: dict[str, float] = {}
    for fn in fns.values():
        fn()
    sync()
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            parts = fn()
            sync()
            if not isinstance(parts, dict):
                parts = {name: time.perf_counter() - start}
            for part, seconds in parts.items():
                best[part] = min(best.get(part, float("inf")), seconds)
    return best


def engine(conn) -> None:
    """The engine's side of the layer-wise loads, in a process of its own as an engine
    is (CUDA opens interprocess events only in a process other than their creator's).
    For each ticket it is sent: the instants at which layer 0, then the last layer, has
    landed for the engine's compute. With CUDA events, ``wait_layer`` returns once the
    engine's stream waits on the layer's event, before the copy is done: the layer has
    landed when that stream has run up to the wait."""
    try:
        handle = CountersHandle.from_dict(conn.recv())
        waiter = LayerWaiter(handle, multiprocessing.reduction.recv_handle(conn))
        stream = None
        if waiter.events is not None:
            torch.cuda.set_device(waiter.events.device)
            stream = torch.cuda.Stream()
        conn.send(("ready", None))
        while (ticket := conn.recv()) is not None:
            ticket = Ticket(*ticket)
            waiter.wait_layer(ticket, 0, timeout_s=WAIT_S, stream=stream)
            first = landed(stream)
            for layer in range(1, handle.num_layers):
                waiter.wait_layer(ticket, layer, timeout_s=WAIT_S, stream=stream)
            conn.send(("landed", (first, landed(stream))))
        waiter.close()
    except BaseException:  # noqa: BLE001 - the parent raises it, with this process's traceback
        conn.send(("error", traceback.format_exc()))


def landed(stream) -> float:
    """Now, once ``stream`` (if any) has run all that was enqueued on it."""
    if stream is not None:
        stream.synchronize()
    return now()


class LayerwiseLoads:
    """Layer-wise loads into ``device_pool``, started as the tier manager starts them —
    the pool registered with :class:`DevicePools` (its mover, over ``copy_workers`` on
    the CPU; its layer counters, with CUDA events on a GPU; its copy engine and the
    transfer thread behind it), each load run by :func:`copy_layers` — and waited for by
    an engine process (:func:`engine`)."""

    def __init__(self, spec: KVSpec, device_pool: DevicePool, host: HostPool,
                 copy_workers: CpuCopyWorkers | None) -> None:
        self.completions = Completions()
        self.workers = Workers(self.completions)
        self.pools = DevicePools(spec, host, CopyEngines(self.workers, self.completions), counter_slots=2,
                                 copy_workers=copy_workers)
        self.state = self.pools.register(PoolId(1), [device_pool])
        # What the manager's transfer holds locked; copy_layers only copies the pages.
        self.hold = HiRadixTree().add_namespace(bytes(16), spec.page_size)
        self.num_layers = spec.num_layers
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.engine = context.Process(target=engine, args=(theirs,), daemon=True)
        self.engine.start()
        theirs.close()
        counters = self.state.counters
        self.conn.send(counters.handle().to_dict())
        ring_fd = counters.reader_fd()
        multiprocessing.reduction.send_handle(self.conn, ring_fd, self.engine.pid)
        os.close(ring_fd)
        self._answer("ready")

    def _answer(self, kind: str) -> object:
        """The engine process's next message, which must be ``kind``; its failure raised."""
        if not self.conn.poll(WAIT_S):
            raise RuntimeError(f"the engine process sent no {kind!r} in {WAIT_S} s")
        got, value = self.conn.recv()
        if got == "error":
            raise RuntimeError(f"the engine process failed:\n{value}")
        assert got == kind, (got, kind)
        return value

    def load(self, host_pages: list[int], device_pages: list[int]) -> dict[str, float]:
        """One load: seconds from its start until layer 0, and until every layer, had
        landed for the engine; and until ``copy_layers`` returned (``enqueue``: how long
        the caller's thread — the daemon's loop — is held by handing the load over, to
        the copy engine's enqueuing thread on a GPU, to the transfer thread on the CPU)."""
        counters = self.state.counters
        ticket = counters.begin()
        entry = Entry(self.hold, np.asarray(host_pages, dtype=np.int64), np.asarray(device_pages, dtype=np.int64))
        transfer = Transfer(Kind.LOAD, self.state.pool_id, [entry], self.hold, ticket=ticket)
        ended: list[BaseException | None] = []
        start = now()
        copy_layers(self.num_layers, self.state, transfer, lambda _, error: ended.append(error))
        enqueued = now()
        # The engine has the ticket once copy_layers has returned, as from the daemon's
        # answer (on a GPU the copies are being enqueued then, on the copy engine's own
        # thread: the engine polls for each layer's stamp, then waits on its event).
        self.conn.send(tuple(ticket))
        first, last = self._answer("landed")
        while not ended:
            if not self.completions.drain(timeout_s=WAIT_S):
                raise RuntimeError(f"load {ticket} did not end in {WAIT_S} s")
        if ended[0] is not None:
            raise ended[0]
        counters.finish(ticket)
        return {"first_layer": first - start, "all_layers": last - start, "enqueue": enqueued - start}

    def close(self) -> None:
        self.conn.send(None)
        self.engine.join(WAIT_S)
        self.conn.close()
        self.pools.close()
        self.workers.close()


def per_layer_layout(spec: KVSpec, num_blocks: int) -> ForeignLayout:
    """vLLM's layout on a GPU: one ``KVCacheTensor`` per layer, its blocks one after the
    other, each block one run of the layer's K and V (``[B, 2, N, H, hd]``)."""
    block_bytes = spec.page_bytes(0)
    return ForeignLayout(spec, num_blocks, block_bytes, tuple(
        Allocation(num_blocks * block_bytes, (layer,), 0, block_bytes) for layer in range(spec.num_layers)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=256, help="pages moved per copy")
    parser.add_argument("--pool-pages", type=int, default=512, help="pages in the device and host pools")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--copy-threads", type=int, default=2, help="CPU copy threads (CPU mode)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.pages > args.pool_pages:
        parser.error("--pages must not exceed --pool-pages")

    # (named for the engine-owned pool, whose spec must name its layout: one spec, so
    # that both pools share the host pool)
    spec = KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, model="bench",
                      layout="bench/per-layer")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    exported = export_kv_pool(spec, args.pool_pages, device=device)
    host = HostPool(spec, args.pool_pages, pinned=cuda)
    workers = None if cuda else CpuCopyWorkers(args.copy_threads)
    mover = PageMover(exported.pool, host, workers=workers)
    loads = LayerwiseLoads(spec, exported.pool, host, workers)
    owned_layout = per_layer_layout(spec, args.pool_pages + 1)  # (block 0 is the engine's null block)
    owned = [torch.randint(0, 256, (a.size,), dtype=torch.uint8, device=device) for a in owned_layout.allocations]
    foreign = ForeignMover(ForeignPool(owned_layout, owned, [None] * len(owned)), host, workers=workers)
    exported.pool.buffer.random_(0, 256)
    host.pages.random_(0, 256)

    n = args.pages
    nbytes = n * mover.bytes_per_page
    g = torch.Generator().manual_seed(0)
    dev_random = (torch.randperm(args.pool_pages, generator=g)[:n] + 1).tolist()
    host_random = torch.randperm(args.pool_pages, generator=g)[:n].tolist()
    dev_run = list(range(1, n + 1))
    host_run = list(range(n))

    # The floor: copy_ of the same bytes between preallocated contiguous buffers.
    dev_flat = exported.pool.buffer[:nbytes]
    host_flat = host.pages[:nbytes]
    timings = best_seconds({
        "copy_d2h": lambda: host_flat.copy_(dev_flat, non_blocking=cuda),
        "copy_h2d": lambda: dev_flat.copy_(host_flat, non_blocking=cuda),
        "gather": lambda: mover.backup(dev_random, host_random),
        "scatter": lambda: mover.load_all(host_random, dev_random),
        "layerwise_scatter": lambda: mover.load(host_random, dev_random),
        "gather_contiguous": lambda: mover.backup(dev_run, host_run),
        "scatter_contiguous": lambda: mover.load_all(host_run, dev_run),
        "layerwise_load": lambda: loads.load(host_random, dev_random),
        "foreign_layerwise_scatter": lambda: foreign.load(host_random, dev_random),
        "foreign_gather": lambda: foreign.backup(dev_random, host_random),
    }, args.repeat, sync)
    copy_d2h = timings.pop("copy_d2h")
    copy_h2d = timings.pop("copy_h2d")
    first_layer = timings.pop("first_layer")
    all_layers = timings.pop("all_layers")
    enqueue = timings.pop("enqueue")
    copy_s = min(copy_d2h, copy_h2d)
    figures: dict[str, float | int | str] = {
        "device": str(device), "pages": n, "bytes": nbytes, "page_bytes": mover.bytes_per_page,
        "torch_threads": torch.get_num_threads(),
    }
    if cuda:
        # On a GPU the floor differs by direction (D2H and H2D over PCIe / C2C).
        figures["copy_d2h_gbps"] = nbytes / copy_d2h / 1e9
        figures["copy_h2d_gbps"] = nbytes / copy_h2d / 1e9
        floors = {"gather": copy_d2h, "scatter": copy_h2d}
        figures["copy_gbps"] = nbytes / min(copy_d2h, copy_h2d) / 1e9
    else:
        figures["copy_gbps"] = nbytes / copy_s / 1e9
        floors = {"gather": copy_s, "scatter": copy_s}
    for name, seconds in timings.items():
        figures[f"{name}_gbps"] = nbytes / seconds / 1e9
        floor = floors["gather" if "gather" in name else "scatter"]
        figures[f"{name}_ratio"] = floor / seconds
    figures["first_layer_ms"] = first_layer * 1e3
    figures["all_layers_ms"] = all_layers * 1e3
    figures["whole_copy_ms"] = copy_h2d * 1e3
    figures["enqueue_ms"] = enqueue * 1e3
    figures["first_layer_ratio"] = first_layer / copy_h2d
    figures["all_layers_ratio"] = all_layers / copy_h2d

    print(f"{n} pages x {mover.bytes_per_page / 2**20:.1f} MiB = {nbytes / 2**20:.0f} MiB per copy, "
          f"{device}, torch threads {torch.get_num_threads()}")
    print(f"{'copy':24} {'GB/s':>8} {'vs copy_':>9}")
    for name in timings:
        print(f"{name:24} {figures[f'{name}_gbps']:8.2f} {figures[f'{name}_ratio']:9.2f}")
    print(f"{'copy_ (same bytes)':24} {figures['copy_gbps']:8.2f}")
    print(f"layer-wise load of {spec.num_layers} layers, waited for by an engine process: first layer "
          f"{figures['first_layer_ms']:.2f} ms ({figures['first_layer_ratio']:.3f} of the whole copy_), "
          f"all layers {figures['all_layers_ms']:.2f} ms ({figures['all_layers_ratio']:.2f}); "
          f"whole copy_ host -> device {figures['whole_copy_ms']:.2f} ms; the load's start took "
          f"{figures['enqueue_ms']:.2f} ms on the caller's thread")
    if args.json:
        print(json.dumps(figures))
    loads.close()
    if workers is not None:
        workers.close()
    host.close()
    exported.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
