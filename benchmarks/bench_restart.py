"""Warm-restart benchmark: how long a restarted daemon takes to rebuild its disk tier.

Writes a store shaped like a serving fleet's (``--prompts`` shared prefixes of
``--prompt-pages`` pages, ``--conversations`` sequences of ``--conversation-pages``
pages under them, round robin), closes it, then in one run times:

* ``open``: opening the LMDB store (reading its LRU index);
* ``rebuild``: :meth:`TierManager.rebuild_from_storage` — every record of the spec
  back into a fresh tree as disk-resident, walked top-down from each first page;
* ``baseline``: the same restores with the chains walked bottom-up from every leaf
  (how it was done before: O(leaves x depth)).

Both rebuilds must produce the same tree (same disk pages, same node count).

* ``serve``: ``hicache serve`` on that store with another engine (another model)
  already registered and matching in a loop; then this spec's engine registers. Its
  disk tier is rebuilt a slice at a time between the other engine's requests: the
  figures are the registration's time and the other engine's longest and p99 match
  round trip meanwhile — next to the rebuild time, which is how long a daemon that
  rebuilt on the spot (as it did before) kept every other engine waiting.

    python benchmarks/bench_restart.py [--prompts 50] [--prompt-pages 1000] [--conversations 20000] [--json]

With ``--json`` the last line is one JSON object with ``records``, ``open_s``,
``rebuild_s``, ``baseline_s``, ``speedup`` (baseline / rebuild), ``serve_register_s``,
``other_engine_max_ms``, ``other_engine_p99_ms`` and ``stall_ratio`` (rebuild time /
the other engine's longest round trip).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hicache.keys import ROOT_PARENT_KEY, NamespaceId, chain_page_keys, namespace_id
from hicache.spec import KVSpec
from hicache.storage.base import PageMeta, PageRecord
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierManager
from hicache.tree import Tier

PAGE_SIZE = 16


def write_store(path: str, spec: KVSpec, args) -> int:
    namespace = namespace_id(spec.fingerprint)
    rng = np.random.default_rng(0)
    payload = np.zeros(spec.host_page_bytes, dtype=np.uint8)
    store = LmdbBackend(path, capacity_bytes=1 << 40)

    def put_chain(parent: bytes, num_pages: int) -> bytes:
        packed = rng.integers(0, 50_000, num_pages * PAGE_SIZE, dtype=np.int32).tobytes()
        keys = chain_page_keys(namespace, parent, packed, PAGE_SIZE)
        records = []
        step = PAGE_SIZE * 4
        for i in range(num_pages):
            key = keys[i * 16 : (i + 1) * 16]
            records.append(PageRecord(key, payload, PageMeta(namespace, parent, packed[i * step : (i + 1) * step])))
            parent = key
        for start in range(0, len(records), 256):
            store.put(records[start : start + 256], fingerprint=spec.fingerprint)
        return parent

    prompts = [put_chain(ROOT_PARENT_KEY, args.prompt_pages) for _ in range(args.prompts)]
    for i in range(args.conversations):
        put_chain(prompts[i % len(prompts)], args.conversation_pages)
    store.flush()
    records = store.stats().records
    store.close()
    return records


def rebuild_bottom_up(manager: TierManager) -> int:
    """The baseline: from every leaf record, walk the parent chain to the first page."""
    page_bytes = manager.spec.page_size * 4
    metas = {key: meta for key, meta in manager.storage.iter_metadata()
             if meta.fingerprint == manager.spec.fingerprint and len(meta.tokens) == page_bytes}
    has_child = {meta.parent for meta in metas.values()}
    for key, meta in metas.items():
        if key in has_child:
            continue
        chain = []
        current = key
        while current != ROOT_PARENT_KEY:
            record = metas.get(current)
            if record is None or record.namespace != meta.namespace:
                break
            chain.append(record.tokens)
            current = record.parent
        else:
            manager.add_namespace(NamespaceId(meta.namespace))
            manager.tree.restore(NamespaceId(meta.namespace), b"".join(reversed(chain)))
    return manager.tree.sizes(Tier.DISK).cached


def timed_rebuild(path: str, spec: KVSpec, bottom_up: bool) -> tuple[float, float, int, int]:
    start = time.perf_counter()
    store = LmdbBackend(path, capacity_bytes=1 << 40)
    opened = time.perf_counter()
    manager = TierManager(spec, host_pages=16, storage=store)
    begin = time.perf_counter()
    pages = rebuild_bottom_up(manager) if bottom_up else manager.rebuild_from_storage()
    done = time.perf_counter()
    nodes = len(manager.tree)
    manager.close()
    store.close()
    return opened - start, done - begin, pages, nodes


def other_engine(endpoint: str, spec: KVSpec, ready, stop, results) -> None:
    """Another model's engine: registers, caches a sequence, then matches it until told
    to stop, timing every round trip."""
    from hicache.client import CacheClient
    from hicache.engine.kv_pool import export_kv_pool

    exported = export_kv_pool(spec, 64)
    client = CacheClient(endpoint, load_timeout_s=600.0)
    client.register(spec, [exported.handle])
    tokens = np.arange(4 * PAGE_SIZE, dtype=np.int32) + 7_000_000
    client.insert(tokens, client.alloc(4))
    ready.set()
    samples = []  # (start, seconds); time.monotonic is one clock for every process here
    while not stop.is_set():
        start = time.monotonic()
        match = client.match(tokens)
        samples.append((start, time.monotonic() - start if match.num_device_pages == 4 else float("inf")))
    results.put(samples)
    client.close()
    exported.close()


def serve_while_rebuilding(root: str, spec: KVSpec) -> tuple[float, list[float], int]:
    """Times this spec's first registration with ``hicache serve`` while another
    engine is being served; returns (register seconds, the other engine's round trips
    that started meanwhile — a degraded one counts as infinite —, disk pages the daemon
    reports for this spec)."""
    from hicache.client import CacheClient
    from hicache.daemon.spawn import start_daemon, stop_daemon
    from hicache.engine.kv_pool import export_kv_pool

    directory = Path(tempfile.mkdtemp(prefix="hicache-bench-restart-serve-"))
    daemon = start_daemon(directory, f'[server]\nsocket = "{directory / "hicache.sock"}"\n'
                                     f'[disk]\npath = "{root}"\ncapacity_bytes = {1 << 40}\n[metrics]\nport = 0\n',
                          name="bench_restart", timeout_s=300.0)
    endpoint = f"ipc://{directory / 'hicache.sock'}"
    ctx = multiprocessing.get_context("spawn")
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    other = ctx.Process(target=other_engine,
                        args=(endpoint, dataclasses.replace(spec, model="bench-restart-other"), ready, stop, results))
    try:
        other.start()
        if not ready.wait(600):
            raise SystemExit("bench_restart: the other engine did not come up")
        time.sleep(0.5)  # a few round trips before
        exported = export_kv_pool(spec, 64)
        client = CacheClient(endpoint, load_timeout_s=600.0, heartbeat=False)
        start = time.monotonic()
        client.register(spec, [exported.handle])
        end = time.monotonic()
        time.sleep(0.2)
        stop.set()
        samples = [seconds for at, seconds in results.get(timeout=60) if start <= at <= end]
        disk = client.stats()["specs"][spec.fingerprint.hex()]["disk"]
        client.close()
        exported.close()
        other.join(30)
    finally:
        stop_daemon(daemon, directory)
    return end - start, samples, disk["cached_evictable"] + disk["cached_protected"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--prompt-pages", type=int, default=1000)
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--conversation-pages", type=int, default=20)
    parser.add_argument("--dir", default=None, help="where the temporary store goes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=PAGE_SIZE, model="bench-restart")
    root = tempfile.mkdtemp(prefix="hicache-bench-restart-", dir=args.dir)
    try:
        records = write_store(root, spec, args)
        open_s, rebuild_s, pages, nodes = timed_rebuild(root, spec, bottom_up=False)
        _, baseline_s, baseline_pages, baseline_nodes = timed_rebuild(root, spec, bottom_up=True)
        register_s, other_samples, served_pages = serve_while_rebuilding(root, spec)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if (pages, nodes) != (baseline_pages, baseline_nodes) or pages != records:
        raise SystemExit(f"rebuilds disagree: {pages} pages / {nodes} nodes vs {baseline_pages} / {baseline_nodes}, "
                         f"{records} records")
    if served_pages != records:
        raise SystemExit(f"the daemon restored {served_pages} pages of {records} records")
    other_max = max(other_samples)
    figures = {"records": records, "nodes": nodes, "open_s": round(open_s, 3), "rebuild_s": round(rebuild_s, 3),
               "baseline_s": round(baseline_s, 3), "speedup": round(baseline_s / rebuild_s, 2),
               "serve_register_s": round(register_s, 3), "other_engine_matches": len(other_samples),
               "other_engine_max_ms": round(other_max * 1e3, 2),
               "other_engine_p99_ms": round(float(np.percentile(other_samples, 99)) * 1e3, 3),
               "stall_ratio": round(rebuild_s / other_max, 1)}
    print(f"{records:,} records ({args.prompts} prefixes of {args.prompt_pages} pages, {args.conversations:,} "
          f"sequences of {args.conversation_pages} pages), {nodes:,} tree nodes")
    print(f"open the store {open_s:.2f} s; rebuild top-down {rebuild_s:.2f} s; "
          f"bottom-up baseline {baseline_s:.2f} s ({baseline_s / rebuild_s:.1f}x)")
    print(f"hicache serve: registering the spec took {register_s:.2f} s; another engine's "
          f"{len(other_samples):,} matches meanwhile: longest {other_max * 1e3:.1f} ms, "
          f"p99 {figures['other_engine_p99_ms']:.2f} ms (a rebuild on the spot kept it waiting "
          f"{rebuild_s:.2f} s: {figures['stall_ratio']:.0f}x)")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
