"""Trace benchmark: prefill tokens saved by hicache on the multi-turn workload.

Replays the 2,000 requests of ``workloads.multi_turn`` (each conversation turn is a
request for the whole conversation so far), and a variant where every conversation
shares one system prompt, three ways:

* **hicache** — a real ``hicache serve`` process; an engine with a device pool of 10% of
  the workload's unique pages, a host pool of 40% (each at least twice the longest
  request, which matters only for a shrunken ``--conversations`` run), the disk tier
  unbounded (LMDB in a temporary directory). Each request: match, lock, load, alloc the rest, insert,
  unlock — the client's real lifecycle — and the tokens it did not have to prefill
  are counted by the tier that served them;
* **device only** — the same requests against an in-process tree with the same device
  pool and nothing behind it (what a plain radix cache, SGLang's RadixCache, gives);
* **oracle** — an infinite cache (every page ever computed stays).

A request always computes at least its last token, so a hit is capped at the whole
pages before it.

    python benchmarks/bench_trace.py [--json] [--plot PATH | --no-plot] [--conversations N]

The plot (hit tokens by tier over the run; cumulative tokens saved vs the baseline and
the oracle) goes to ``docs/trace.png`` by default, or to ``--plot PATH``; it needs
matplotlib, from the ``bench`` extra (``pip install -e '.[bench]'``). With ``--json`` the
run draws no plot unless ``--plot`` asks for one, and the last line is one JSON object:
``saved_tokens``, ``oracle_saved_tokens``, ``baseline_saved_tokens``,
``saved_vs_oracle``, ``saved_vs_baseline``, ``saved_device_tokens``,
``saved_host_tokens``, ``saved_disk_tokens``, the same for the shared-prompt variant
(``shared_*``). ``--conversations`` shrinks the workload (200 by default, the figures
in the README) for a quick run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import multi_turn  # noqa: E402

from hicache.client import CacheClient  # noqa: E402
from hicache.daemon.spawn import start_daemon, stop_daemon  # noqa: E402
from hicache.engine.kv_pool import export_kv_pool  # noqa: E402
from hicache.keys import namespace_id, page_keys  # noqa: E402
from hicache.pages import PageAllocator  # noqa: E402
from hicache.spec import KVSpec  # noqa: E402
from hicache.tree import HiRadixTree, Tier  # noqa: E402

PAGE_SIZE = 16
SPEC = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=PAGE_SIZE, model="bench-trace")
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PLOT = ROOT / "docs" / "trace.png"
NEEDS_MATPLOTLIB = "the plot needs matplotlib, from the bench extra: pip install -e '.[bench]' (or pass --no-plot)"


def usable_pages(tokens: np.ndarray) -> int:
    """Whole pages a request may take from the cache (its last token is computed)."""
    return (len(tokens) - 1) // PAGE_SIZE


def unique_pages(requests) -> int:
    ns = namespace_id(SPEC.fingerprint)
    keys = set()
    for tokens in requests:
        keys.update(page_keys(ns, tokens, PAGE_SIZE))
    return len(keys)


def run_hicache(requests, device_pages: int, host_pages: int) -> list[tuple[int, int, int]]:
    """Saved tokens per request, by tier (device, host, disk), through a real daemon."""
    directory = Path(tempfile.mkdtemp(prefix="hicache-trace-"))
    daemon = start_daemon(directory, (
        f'[server]\nsocket = "{directory / "hicache.sock"}"\n'
        f'[host]\nbytes = {host_pages * SPEC.host_page_bytes}\n'
        f'[disk]\npath = "{directory / "lmdb"}"\ncapacity_bytes = {1 << 34}\n'
        '[metrics]\nenabled = false\n'
    ), name="bench_trace")
    kv = export_kv_pool(SPEC, device_pages)
    try:
        client = CacheClient(f"ipc://{directory / 'hicache.sock'}", timeout_s=30.0)
        client.register(SPEC, [kv.handle])
        saved = []
        for tokens in requests:
            m = client.match(tokens)
            client.lock(m.handle)
            loaded = client.load(m.handle)
            usable = min(len(loaded.device_pages), usable_pages(tokens))
            device = min(m.num_device_pages, usable)
            host = min(m.num_host_pages, usable - device)
            saved.append((device * PAGE_SIZE, host * PAGE_SIZE, (usable - device - host) * PAGE_SIZE))
            for layer in range(SPEC.num_layers):
                client.wait_layer(loaded.wait, layer, timeout_s=30)
            whole = len(tokens) // PAGE_SIZE
            new = client.alloc(whole - usable)
            deadline = time.monotonic() + 60
            while new is None:  # "no pages yet": the daemon's pages wait on copies to host
                if time.monotonic() > deadline:
                    raise SystemExit("the device pool ran dry")
                time.sleep(0.002)
                new = client.alloc(whole - usable)
            pages = np.concatenate((loaded.device_pages[:usable], new))
            client.insert(tokens[: whole * PAGE_SIZE], pages)
            client.unlock(m.handle)
        client.close()
        return saved
    finally:
        kv.close()
        stop_daemon(daemon, directory, 60)


def _evict_device(tree: HiRadixTree, num_pages: int) -> np.ndarray:
    """Drop at least ``num_pages`` device pages of pool 0, LRU leaves first; their ids."""
    freed, count = [], 0
    for node in tree.iter_evictable(Tier.DEVICE, 0):
        if count >= num_pages:
            break
        freed.append(tree.drop(node, Tier.DEVICE, 0))
        count += len(freed[-1])
    return np.concatenate(freed) if freed else np.empty(0, dtype=np.int32)


def run_tree(requests, device_pages: int | None) -> list[int]:
    """Saved tokens per request with a device-only tree (``None``: unbounded, the oracle)."""
    ns = namespace_id(SPEC.fingerprint)
    tree = HiRadixTree()
    tree.add_namespace(ns, PAGE_SIZE)
    capacity = device_pages if device_pages is not None else sum(len(t) // PAGE_SIZE for t in requests) + 1
    alloc = PageAllocator.for_device(capacity)
    saved = []
    for tokens in requests:
        m = tree.match(ns, tokens, 0)
        usable = min(m.num_device_pages, usable_pages(tokens))
        saved.append(usable * PAGE_SIZE)
        tree.lock(m.node, 0)
        whole = len(tokens) // PAGE_SIZE
        need = whole - usable
        if alloc.num_free < need:
            alloc.free(_evict_device(tree, need - alloc.num_free))
        new = alloc.alloc(need)
        result = tree.insert(ns, tokens[: whole * PAGE_SIZE], 0, np.concatenate((m.device_pages[:usable], new)))
        alloc.free(result.duplicate_pages)
        tree.unlock(m.node, 0)
    return saved


def measure(requests, label: str) -> dict:
    unique = unique_pages(requests)
    # A pool must hold the longest request's pages twice over (pages of the previous
    # request may still be pinned by their backup) and the padding page: that floor only
    # matters for a shrunken workload (--conversations); the full one is far above it.
    floor = 2 * max(len(t) // PAGE_SIZE for t in requests) + 1
    device, host = max(floor, unique // 10), max(floor, unique * 4 // 10)
    total = sum(len(t) for t in requests)
    start = time.perf_counter()
    ours = run_hicache(requests, device, host)
    seconds = time.perf_counter() - start
    baseline = run_tree(requests, device)
    oracle = run_tree(requests, None)
    saved = sum(sum(s) for s in ours)
    figures = {
        "requests": len(requests), "prompt_tokens": total, "unique_pages": unique,
        "device_pages": device, "host_pages": host, "seconds": seconds,
        "saved_tokens": saved, "computed_tokens": total - saved,
        "saved_device_tokens": sum(s[0] for s in ours), "saved_host_tokens": sum(s[1] for s in ours),
        "saved_disk_tokens": sum(s[2] for s in ours),
        "baseline_saved_tokens": sum(baseline), "oracle_saved_tokens": sum(oracle),
    }
    figures["saved_vs_oracle"] = saved / figures["oracle_saved_tokens"]
    figures["saved_vs_baseline"] = saved / figures["baseline_saved_tokens"]
    print(f"{label}: {len(requests)} requests, {total:,} prompt tokens, {unique:,} unique pages; "
          f"device {device} pages, host {host}, disk unbounded ({seconds:.1f} s)")
    print(f"  {'':18} {'saved tokens':>13} {'vs oracle':>10}")
    for name, value in (("hicache", saved), ("  from device", figures["saved_device_tokens"]),
                        ("  from host", figures["saved_host_tokens"]), ("  from disk", figures["saved_disk_tokens"]),
                        ("device only", figures["baseline_saved_tokens"]), ("oracle", figures["oracle_saved_tokens"])):
        print(f"  {name:18} {value:13,} {value / figures['oracle_saved_tokens']:10.3f}")
    print(f"  hicache saves {figures['saved_vs_baseline']:.2f}x the device-only cache's tokens")
    return figures | {"series": (ours, baseline, oracle)}


def plot(path: Path, trace: dict) -> None:
    import matplotlib  # here only: the benchmark's figures need no plotting library

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, baseline, oracle = trace["series"]
    n = len(ours)
    window = 50
    x = np.arange(n)
    by_tier = np.asarray(ours, dtype=float)
    counts = np.minimum(np.arange(1, n + 1), window)  # a trailing mean: no dip at either end
    smooth = np.stack([np.convolve(by_tier[:, i], np.ones(window))[:n] / counts for i in range(3)])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.stackplot(x, smooth, labels=["device", "host", "disk"], colors=["#2b8cbe", "#7bccc4", "#f0a05a"])
    top.set_ylabel(f"hit tokens per request\n({window}-request mean)")
    top.set_title("hicache on the multi-turn workload: where hits come from")
    top.legend(loc="upper left")
    for series, name, style in ((ours, "hicache", "C0-"), (oracle, "oracle (infinite cache)", "k--"),
                                (baseline, "device only (plain radix cache)", "C3-")):
        values = np.asarray(series, dtype=float)
        total = values.sum(axis=1) if values.ndim == 2 else values
        bottom.plot(x, np.cumsum(total) / 1e6, style, label=name)
    bottom.set_xlabel("request")
    bottom.set_ylabel("cumulative prefill tokens saved (M)")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=200, help="conversations of 10 turns each")
    plotting = parser.add_mutually_exclusive_group()
    plotting.add_argument("--plot", type=Path, default=None, help=f"where the plot goes (default {DEFAULT_PLOT})")
    plotting.add_argument("--no-plot", action="store_true")
    parser.add_argument("--json", action="store_true", help="figures as JSON on the last line; no plot unless --plot")
    args = parser.parse_args(argv)
    if args.conversations < 1:
        parser.error("--conversations must be at least 1")
    plot_path = None if args.no_plot or (args.json and args.plot is None) else args.plot or DEFAULT_PLOT
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error(NEEDS_MATPLOTLIB)  # before the run, not after it

    # The benchmark replays the inserts only; no lookups are drawn (they come after the
    # inserts in the generator, so the inserts are the same either way).
    size = {"num_conversations": args.conversations, "num_lookups": 0}
    main_trace = measure(multi_turn(args.seed, **size).inserts, "multi-turn")
    shared = measure(multi_turn(args.seed, num_system_prompts=1, **size).inserts, "shared system prompt")
    if plot_path is not None:
        plot(plot_path, main_trace)
        print(f"plot: {plot_path}")
    figures = {k: v for k, v in main_trace.items() if k != "series"}
    figures.update({f"shared_{k}": v for k, v in shared.items() if k != "series"})
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
