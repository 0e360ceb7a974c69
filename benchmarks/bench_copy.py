"""Page-copy benchmark: device -> host gather and host -> device scatter vs ``copy_``.

A 32-layer MHA spec (8 KV heads x 128, fp16, page size 16: 64 KiB per layer-page,
2 MiB per host page). On a CPU machine the "device" pool is the engine's shared-memory
pool and the copies take the torch path of hicache.kernels.page_copy; with CUDA the
device pool is on the GPU, the host pool pinned, and the copies run the Triton kernel.

For each direction it moves ``--pages`` pages between random, unsorted page ids (and,
separately, between contiguous runs), and compares with a plain ``copy_`` of the same
number of bytes between two preallocated contiguous buffers on the same devices. Each
figure is the best of ``--repeat`` rounds, every variant run once per round.

    python benchmarks/bench_copy.py [--pages 256] [--json]

With ``--json`` the last line is one JSON object: ``gather_gbps``, ``scatter_gbps``,
``copy_gbps``, ``gather_ratio``, ``scatter_ratio`` and the layer-wise and contiguous
variants.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from hicache.engine.kv_pool import export_kv_pool
from hicache.kernels.copy_plan import CpuCopyWorkers
from hicache.pools import HostPool
from hicache.spec import KVSpec
from hicache.transfer import PageMover


def best_seconds(fns: dict, repeat: int, sync) -> dict[str, float]:
    """Best time of each function over ``repeat`` rounds, the functions interleaved
    within each round so that a slow spell of the machine hits all of them alike."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    sync()
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


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

    spec = KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, model="bench")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    exported = export_kv_pool(spec, args.pool_pages, device=device)
    host = HostPool(spec, args.pool_pages, pinned=cuda)
    workers = None if cuda else CpuCopyWorkers(args.copy_threads)
    mover = PageMover(exported.pool, host, workers=workers)
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
    }, args.repeat, sync)
    copy_d2h = timings.pop("copy_d2h")
    copy_h2d = timings.pop("copy_h2d")
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
        floor = floors["gather" if name.startswith("gather") else "scatter"]
        figures[f"{name}_ratio"] = floor / seconds

    print(f"{n} pages x {mover.bytes_per_page / 2**20:.1f} MiB = {nbytes / 2**20:.0f} MiB per copy, "
          f"{device}, torch threads {torch.get_num_threads()}")
    print(f"{'copy':24} {'GB/s':>8} {'vs copy_':>9}")
    for name in timings:
        print(f"{name:24} {figures[f'{name}_gbps']:8.2f} {figures[f'{name}_ratio']:9.2f}")
    print(f"{'copy_ (same bytes)':24} {figures['copy_gbps']:8.2f}")
    if args.json:
        print(json.dumps(figures))
    if workers is not None:
        workers.close()
    host.close()
    exported.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
