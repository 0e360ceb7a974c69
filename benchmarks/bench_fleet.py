"""Fleet benchmark: two nodes, one Mooncake Store, the remote tier against its floor.

Everything runs on this machine: a ``mooncake_master``, a segment holder
(``mooncake_client``) and, standing for two nodes, two ``hicache serve`` daemons on
separate state directories.

1. **Tokens saved.** The multi-turn chat workload (``workloads.multi_turn``: shared
   system prompts, conversations turn by turn) split across the two nodes the way a
   router that knows nothing of caches splits it: each request goes to a random node.
   An engine on each node runs every request as engines do (match, lock, load, alloc,
   insert, unlock). Run twice — the daemons without a remote tier, then (fresh daemons,
   fresh store) with it — ``saved_tokens`` is the prompt tokens served from a cache
   with the remote tier, ``saved_tokens_local_only`` without; ``fleet_gain`` their ratio.
2. **Remote get / put throughput.** Two tier managers (two nodes' caches, in this
   process) on the same store, a 16-layer fp16 spec (1 MiB host pages): node A's engine
   prefills ``--pages`` pages (written through to the store); node B matches the
   sequence, which brings every page from the store into its host memory — lookup, get
   into registered host pages, checksums, the tree — timed from the match to its answer:
   ``remote_get_gbps``. The floor: Mooncake's own ``batch_get_into`` /
   ``batch_put_from`` of the same number of objects of the same size between registered
   buffers, by one client (``mooncake_get_gbps``, ``mooncake_put_gbps``); and node A's
   write-through, from the put's submission (its pages on host) to its completion
   (``remote_put_gbps``, from the transfer metric). Best of ``--repeat``. Target: ``remote_get_ratio`` >= 0.8.

    python benchmarks/bench_fleet.py [--pages 256] [--requests 400] [--json]

Needs Mooncake Store (``pip install 'hicache[remote]'``; Debian: ``libibverbs1``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hicache.client import CacheClient
from hicache.daemon.spawn import start_daemon
from hicache.engine.kv_pool import export_kv_pool
from hicache.keys import namespace_id
from hicache.spec import KVSpec
from hicache.storage.mooncake_local import LocalMooncake

sys.path.insert(0, str(Path(__file__).parent))
from workloads import multi_turn  # noqa: E402

BIN = Path(sys.executable).parent
# The workload's spec: small pages of KV (the tokens saved do not depend on their size).
CHAT_SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16, dtype="float16", model="bench-fleet")
# The throughput spec: 16 layers x 8 KV heads x 128, fp16, page 16 -> 1 MiB host pages.
BIG_SPEC = KVSpec.mha(num_layers=16, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16",
                      model="bench-fleet-big")


class Node:
    """``hicache serve`` on a state directory of its own, and an engine talking to it."""

    def __init__(self, directory: Path, remote: str | None, device_pages: int) -> None:
        directory.mkdir(parents=True)
        self.directory = directory
        lines = ["[server]", f'socket = "{directory / "hicache.sock"}"', "lease_s = 30.0",
                 "[host]", "ratio = 2.0",
                 "[disk]", f'path = "{directory / "lmdb"}"', f"capacity_bytes = {8 * device_pages * CHAT_SPEC.host_page_bytes}",
                 "[metrics]", "enabled = false"]
        if remote:
            lines += ["[remote]", "enabled = true", f'master = "{remote}"', 'prefetch_policy = "wait_complete"']
        self.proc = start_daemon(directory, "\n".join(lines) + "\n", name="bench_fleet")
        self.client = CacheClient(f"ipc://{directory / 'hicache.sock'}", timeout_s=30.0)
        self.kv = export_kv_pool(CHAT_SPEC, device_pages)
        self.client.register(CHAT_SPEC, [self.kv.handle])

    def request(self, tokens: np.ndarray) -> int:
        """One request as an engine runs it; returns the prompt tokens served from the
        cache (never the last one: its logits start decoding)."""
        ps = CHAT_SPEC.page_size
        m = self.client.match(tokens)
        self.client.lock(m.handle)
        try:
            loaded = self.client.load(m.handle)
            if loaded.wait:
                for layer in range(CHAT_SPEC.num_layers):
                    self.client.wait_layer(loaded.wait, layer, timeout_s=60)
            usable = min(len(loaded.device_pages), (len(tokens) - 1) // ps)
            need = len(tokens) // ps - len(loaded.device_pages)
            new = self.client.alloc(need)
            deadline = time.monotonic() + 60
            while new is None and time.monotonic() < deadline:
                time.sleep(0.005)
                new = self.client.alloc(need)
            if new is None:
                raise RuntimeError("the daemon had no device pages")
            self.client.insert(tokens, np.concatenate((loaded.device_pages, new)))
        finally:
            self.client.unlock(m.handle)
        return usable * ps

    def stop(self) -> None:
        self.client.close()
        self.kv.close()
        self.proc.terminate()
        self.proc.wait(60)


def saved_tokens(workdir: Path, requests: int, seed: int, remote: str | None) -> tuple[int, int]:
    """(tokens served from a cache, prompt tokens) of the workload split across two nodes."""
    work = multi_turn(seed, num_conversations=max(1, requests // 6), num_turns=6, num_lookups=0)
    nodes = [Node(workdir / f"node{i}", remote, device_pages=256) for i in range(2)]
    rng = np.random.default_rng(seed + 1)
    saved = total = 0
    try:
        for tokens in work.inserts[:requests]:
            node = nodes[int(rng.integers(0, 2))]
            saved += node.request(tokens)
            total += len(tokens)
    finally:
        for node in nodes:
            node.stop()
    return saved, total


def throughput(store: LocalMooncake, pages: int, repeat: int) -> dict[str, float]:
    """Remote get / put GB/s through two tier managers, and Mooncake's own floor."""
    from hicache.metrics import Metrics
    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig, object_name
    from hicache.tiers import TierConfig, TierManager
    from hicache.tiers.remote import RemoteSettings

    spec = BIG_SPEC
    ns = namespace_id(spec.fingerprint)
    page_bytes = spec.host_page_bytes
    nbytes = pages * page_bytes
    figures: dict[str, list[float]] = {"get": [], "put": [], "mc_get": [], "mc_put": []}
    rng = np.random.default_rng(0)
    settings = RemoteSettings(prefetch_policy="wait_complete", lookup_pages=pages, write_backlog=pages)
    for attempt in range(repeat):
        backends = [MooncakeBackend(MooncakeConfig(master=store.master, buffer_bytes=64 << 20)) for _ in range(2)]
        pools = [export_kv_pool(spec, pages + 1) for _ in range(2)]
        metrics = [Metrics() for _ in range(2)]
        managers = [TierManager(spec, host_pages=pages + 8, config=TierConfig(disk_policy="none"), remote=b,
                                remote_settings=settings, metrics=mt) for b, mt in zip(backends, metrics)]
        try:
            for m, pool in zip(managers, pools):
                m.add_namespace(ns)
                m.register_pool(0, [pool.pool])
            a, b = managers
            tokens = rng.integers(0, 100_000, pages * spec.page_size + 1).astype(np.int32)
            device = a.alloc(0, pages)
            pools[0].pool.buffer.numpy()[:] = rng.integers(0, 256, pools[0].pool.buffer.numel(), dtype=np.uint8)
            a.insert(ns, tokens, 0, device)
            a.flush()
            # The write-through's own time (from the put's submission, once the pages were
            # on host, to its completion on the owner thread): the transfer metric's.
            put_s = metrics[0].registry.get_sample_value("hicache_transfer_duration_seconds_sum",
                                                         {"direction": "host_to_remote"})
            figures["put"].append(nbytes / put_s)
            if a.remote.counts["pages_put"] != pages:
                raise RuntimeError(f"node A put {a.remote.counts['pages_put']} of {pages} pages")
            b.host_pool.pages_array()[:] = 0  # (touched once, as a running daemon's host pages are)
            start = time.perf_counter()
            hit = b.wait(b.lookup(ns, tokens, 0))
            figures["get"].append(nbytes / (time.perf_counter() - start))
            if hit.remote_pages != pages:
                raise RuntimeError(f"node B got {hit.remote_pages} of {pages} pages from the store")
            # The bytes: node B's host pages equal node A's.
            a_host = a.tree.match(ns, tokens, 0, touch=False)
            b_host = b.tree.match(ns, tokens, 0, touch=False)
            assert a_host.num_pages == b_host.num_pages == pages
            stored = [object_name(ns, k) for n in a.tree.path(a_host.node) for k in n.page_key_list()]
            for (na, nb) in zip(a.tree.path(a_host.node), b.tree.path(b_host.node)):
                assert na.num_pages == nb.num_pages
                for ha, hb in zip(na.host_pages, nb.host_pages):
                    if not np.array_equal(a.host_pool.page_array(int(ha)), b.host_pool.page_array(int(hb))):
                        raise RuntimeError("node B's page differs from node A's")
        finally:
            for m in managers:
                m.close()
            for bk in backends:
                bk.close()
            for pool in pools:
                pool.close()
        # The floor: one client, registered buffers, the same objects' count and size.
        raw = store.client(64 << 20)
        try:
            src = np.empty(nbytes, np.uint8)
            src[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
            dst = np.zeros(nbytes, np.uint8)
            raw.register_buffer(src.ctypes.data, nbytes)
            raw.register_buffer(dst.ctypes.data, nbytes)
            keys = [f"floor-{attempt}-{i}" for i in range(pages)]
            start = time.perf_counter()
            codes = raw.batch_put_from(keys, [src.ctypes.data + i * page_bytes for i in range(pages)], [page_bytes] * pages)
            figures["mc_put"].append(nbytes / (time.perf_counter() - start))
            if any(c != 0 for c in codes):
                raise RuntimeError(f"Mooncake's own put failed: {sorted(set(codes))}")
            start = time.perf_counter()
            got = raw.batch_get_into(keys, [dst.ctypes.data + i * page_bytes for i in range(pages)], [page_bytes] * pages)
            figures["mc_get"].append(nbytes / (time.perf_counter() - start))
            if any(g != page_bytes for g in got) or not np.array_equal(src, dst):
                raise RuntimeError(f"Mooncake's own get failed: {sorted(set(got))}")
            raw.batch_remove(keys + stored, force=True)  # (room for the next round: no eviction mid-run)
            raw.unregister_buffer(src.ctypes.data)
            raw.unregister_buffer(dst.ctypes.data)
        finally:
            raw.close()
    return {k: max(v) / 1e9 for k, v in figures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=256, help="pages of 1 MiB moved in the throughput phase")
    parser.add_argument("--requests", type=int, default=400, help="workload requests split across the nodes")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="hicache-bench-fleet-"))
    store = LocalMooncake(workdir, segment_bytes=max(3 << 30, 4 * args.pages * BIG_SPEC.host_page_bytes)).start()
    try:
        local, total = saved_tokens(workdir / "local", args.requests, args.seed, None)
        fleet, total2 = saved_tokens(workdir / "fleet", args.requests, args.seed, store.master)
        assert total == total2
        rates = throughput(store, args.pages, args.repeat)
    finally:
        store.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "prompt_tokens": total,
        "saved_tokens": fleet,
        "saved_tokens_local_only": local,
        "fleet_gain": round(fleet / max(local, 1), 3),
        "remote_get_gbps": round(rates["get"], 3),
        "mooncake_get_gbps": round(rates["mc_get"], 3),
        "remote_get_ratio": round(rates["get"] / rates["mc_get"], 3),
        "remote_put_gbps": round(rates["put"], 3),
        "mooncake_put_gbps": round(rates["mc_put"], 3),
        "remote_put_ratio": round(rates["put"] / rates["mc_put"], 3),
        "page_bytes": BIG_SPEC.host_page_bytes,
        "pages": args.pages,
    }
    print(f"tokens saved, 2 nodes: {fleet} with the remote tier, {local} without "
          f"(x{result['fleet_gain']}; {total} prompt tokens)")
    print(f"remote get: {result['remote_get_gbps']} GB/s, Mooncake batch_get_into {result['mooncake_get_gbps']} GB/s "
          f"(ratio {result['remote_get_ratio']})")
    print(f"remote put: {result['remote_put_gbps']} GB/s, Mooncake batch_put_from {result['mooncake_put_gbps']} GB/s "
          f"(ratio {result['remote_put_ratio']})")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
