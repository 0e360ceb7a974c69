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
   write-through timed from the insert to its flush (``remote_put_gbps``). Best of
   ``--repeat``. Target: ``remote_get_ratio`` >= 0.8.

    python benchmarks/bench_fleet.py [--pages 256] [--requests 400] [--json]

Needs Mooncake Store (``pip install 'hicache[remote]'``; Debian: ``libibverbs1``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hicache.client import CacheClient
from hicache.engine.kv_pool import export_kv_pool
from hicache.keys import namespace_id
from hicache.spec import KVSpec

sys.path.insert(0, str(Path(__file__).parent))
from workloads import multi_turn  # noqa: E402

BIN = Path(sys.executable).parent
# The workload's spec: small pages of KV (the tokens saved do not depend on their size).
CHAT_SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16, dtype="float16", model="bench-fleet")
# The throughput spec: 16 layers x 8 KV heads x 128, fp16, page 16 -> 1 MiB host pages.
BIG_SPEC = KVSpec.mha(num_layers=16, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16",
                      model="bench-fleet-big")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args[0]} did not listen on {port}")


class Store:
    """A Mooncake master and a segment holder of ``segment_bytes``."""

    def __init__(self, workdir: Path, segment_bytes: int) -> None:
        self.workdir = workdir
        port = free_port()
        self.master = f"127.0.0.1:{port}"
        log = open(workdir / "mooncake.log", "ab")
        self.procs = [subprocess.Popen([str(BIN / "mooncake_master"), f"--rpc_port={port}",
                                        f"--metrics_port={free_port()}", "--default_kv_lease_ttl=200"],
                                       stdout=log, stderr=log, cwd=workdir)]
        wait_port(port, self.procs[0])
        holder_port = free_port()
        self.procs.append(subprocess.Popen(
            [str(BIN / "mooncake_client"), f"--global_segment_size={segment_bytes}", f"--master_server_address={self.master}",
             "--metadata_server=P2PHANDSHAKE", "--protocol=tcp", "--host=127.0.0.1", f"--port={holder_port}"],
            stdout=log, stderr=log, cwd=workdir))
        wait_port(holder_port, self.procs[1])
        self._wait_segment()

    def client(self, buffer_bytes: int = 16 << 20):
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, buffer_bytes, "tcp", "", self.master) != 0:
            raise RuntimeError("cannot join the store")
        return store

    def _wait_segment(self) -> None:
        store = self.client(1 << 20)
        try:
            deadline = time.monotonic() + 30
            while store.put("bench-probe", b"x") != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("no segment mounted")
                time.sleep(0.1)
        finally:
            store.close()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()
            proc.wait()


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
        config = directory / "hicache.toml"
        config.write_text("\n".join(lines) + "\n")
        env = {**os.environ, "HICACHE_HOME": str(directory)}
        self.proc = subprocess.Popen([str(BIN / "hicache"), "--log-level", "WARNING", "serve", "--config", str(config)],
                                     stdout=open(directory / "daemon.log", "ab"), stderr=subprocess.STDOUT, env=env)
        self.client = CacheClient(f"ipc://{directory / 'hicache.sock'}", timeout_s=30.0)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.health()
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((directory / "daemon.log").read_text()) from None
                time.sleep(0.1)
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


def throughput(store: Store, pages: int, repeat: int) -> dict[str, float]:
    """Remote get / put GB/s through two tier managers, and Mooncake's own floor."""
    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig
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
        managers = [TierManager(spec, host_pages=pages + 8, config=TierConfig(disk_policy="none"), remote=b,
                                remote_settings=settings) for b in backends]
        try:
            for m, pool in zip(managers, pools):
                m.add_namespace(ns)
                m.register_pool(0, [pool.pool])
            a, b = managers
            tokens = rng.integers(0, 100_000, pages * spec.page_size + 1).astype(np.int32)
            device = a.alloc(0, pages)
            pools[0].pool.buffer.numpy()[:] = rng.integers(0, 256, pools[0].pool.buffer.numel(), dtype=np.uint8)
            start = time.perf_counter()
            a.insert(ns, tokens, 0, device)
            a.flush()
            figures["put"].append(nbytes / (time.perf_counter() - start))
            if a.remote.counts["pages_put"] != pages:
                raise RuntimeError(f"node A put {a.remote.counts['pages_put']} of {pages} pages")
            start = time.perf_counter()
            hit = b.wait(b.lookup(ns, tokens, 0))
            figures["get"].append(nbytes / (time.perf_counter() - start))
            if hit.remote_pages != pages:
                raise RuntimeError(f"node B got {hit.remote_pages} of {pages} pages from the store")
            # The bytes: node B's host pages equal node A's.
            a_host = a.tree.match(ns, tokens, 0, touch=False)
            b_host = b.tree.match(ns, tokens, 0, touch=False)
            assert a_host.num_pages == b_host.num_pages == pages
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
                raise RuntimeError("Mooncake's own get failed")
            raw.batch_remove(keys, force=True)
            raw.unregister_buffer(src.ctypes.data)
            raw.unregister_buffer(dst.ctypes.data)
        finally:
            raw.close()
    return {k: max(v) / 1e9 for k, v in figures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=256, help="pages of 1 MiB moved in the throughput phase")
    parser.add_argument("--requests", type=int, default=400, help="workload requests split across the nodes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="hicache-bench-fleet-"))
    store = Store(workdir, segment_bytes=max(2 << 30, 3 * args.pages * BIG_SPEC.host_page_bytes))
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
