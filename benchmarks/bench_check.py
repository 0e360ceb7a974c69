"""How long ``hicache check`` keeps a daemon from answering: a store of ``--pages``
records, through a real daemon.

``hicache serve`` in its own process, a tiny KV spec (1 layer, 1 head, head_dim 8, pages
of 64 tokens: 2 KiB a page, so that the bookkeeping is what is measured); one engine
inserts prompts of ``--prompt-pages`` pages (groups of 16 share their first pages, so
the tree branches) until ``--pages`` pages are in the disk tier (write-through; the host
tier holds a tenth of them), then flushes. Then ``check`` runs ``--rounds`` times while
a second client sends ``health`` after ``health``:

* ``check_s`` — how long a check took (the baseline: a check that holds the loop keeps
  every request waiting for all of it);
* ``max_wait_during_check_s`` — the longest round trip of a ``health`` sent while a
  check ran (ours), and ``wait_vs_check`` — their ratio, worst round (1.0: the loop held
  for the whole check);
* ``health_idle_ms`` — the median round trip with no check running, for scale.

    python benchmarks/bench_check.py [--pages 400000] [--prompt-pages 512] [--rounds 3] [--json]

With ``--json`` the last line is one JSON object with those figures and the setup's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from hicache.client import CacheClient
from hicache.daemon.spawn import start_daemon, stop_daemon
from hicache.engine.kv_pool import export_kv_pool
from hicache.spec import KVSpec

PAGE_SIZE = 64
SPEC = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=PAGE_SIZE, model="bench-check")
SHARED_PAGES = 8  # the first pages of a prompt, shared by the 16 prompts of its group


def fill(client: CacheClient, pages: int, prompt_pages: int) -> int:
    """Insert prompts until ``pages`` distinct pages were inserted; the prompts inserted."""
    inserted = prompts = 0
    while inserted < pages:
        group, member = divmod(prompts, 16)
        shared = np.arange(SHARED_PAGES * PAGE_SIZE, dtype=np.int64) + 1_500_000_000 + group * SHARED_PAGES * PAGE_SIZE
        own = np.arange((prompt_pages - SHARED_PAGES) * PAGE_SIZE, dtype=np.int64) + prompts * prompt_pages * PAGE_SIZE
        tokens = np.concatenate((shared, own))
        new = client.alloc(prompt_pages)
        deadline = time.monotonic() + 120
        while new is None:  # the device pool's pages wait for room below: come back
            if time.monotonic() > deadline:
                raise SystemExit("bench_check: the device pool never came back")
            time.sleep(0.002)
            new = client.alloc(prompt_pages)
        client.insert(tokens, new)
        inserted += prompt_pages - (SHARED_PAGES if member else 0)
        prompts += 1
    return prompts


def timed_checks(endpoint: str, client: CacheClient, rounds: int) -> list[dict]:
    """Each round: one check while another client pings ``health`` back to back."""
    pinger = CacheClient(endpoint, timeout_s=120.0, heartbeat=False)
    out = []
    try:
        for _ in range(rounds):
            calls: list[tuple[float, float]] = []
            stop = threading.Event()

            def ping() -> None:
                while not stop.is_set():
                    started = time.perf_counter()
                    pinger.health()
                    calls.append((started, time.perf_counter()))

            thread = threading.Thread(target=ping)
            thread.start()
            time.sleep(0.05)
            started = time.perf_counter()
            client.check()
            ended = time.perf_counter()
            time.sleep(0.05)
            stop.set()
            thread.join()
            during = [b - a for a, b in calls if a < ended and b > started]
            out.append({"check_s": ended - started, "max_wait_during_check_s": max(during, default=0.0),
                        "pings_during_check": len(during)})
    finally:
        pinger.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=400_000)
    parser.add_argument("--prompt-pages", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    directory = Path(tempfile.mkdtemp(prefix="hicache-bench-check-"))
    host_pages = max(4 * args.prompt_pages, args.pages // 10)
    disk_pages = args.pages + 4 * args.prompt_pages
    daemon = start_daemon(directory, (
        f'[server]\nsocket = "{directory / "hicache.sock"}"\n'
        f'[host]\nbytes = {host_pages * SPEC.host_page_bytes}\n'
        f'[disk]\npath = "{directory / "lmdb"}"\ncapacity_bytes = {disk_pages * SPEC.host_page_bytes}\n'
        '[metrics]\nenabled = false\n'
    ), name="bench_check")
    endpoint = f"ipc://{directory / 'hicache.sock'}"
    kv = export_kv_pool(SPEC, 4 * args.prompt_pages)
    try:
        client = CacheClient(endpoint, timeout_s=120.0)
        client.register(SPEC, [kv.handle])
        started = time.perf_counter()
        prompts = fill(client, args.pages, args.prompt_pages)
        client.flush(timeout_s=600)
        fill_s = time.perf_counter() - started
        (figures,) = client.stats()["specs"].values()
        idle = []
        for _ in range(200):
            t = time.perf_counter()
            client.health()
            idle.append(time.perf_counter() - t)
        rounds = timed_checks(endpoint, client, args.rounds)
        client.close()
    finally:
        kv.close()
        stop_daemon(daemon, directory)
    worst = max(rounds, key=lambda r: r["max_wait_during_check_s"] / r["check_s"])
    result = {
        "pages": args.pages, "prompts": prompts, "tree_pages": int(figures.get("pages", 0)),
        "nodes": int(figures.get("nodes", 0)), "fill_s": round(fill_s, 1),
        "check_s": statistics.median(r["check_s"] for r in rounds),
        "max_wait_during_check_s": max(r["max_wait_during_check_s"] for r in rounds),
        "wait_vs_check": worst["max_wait_during_check_s"] / worst["check_s"],
        "health_idle_ms": statistics.median(idle) * 1e3, "rounds": rounds,
    }
    print(f"{result['tree_pages']} pages in the tree ({result['nodes']} nodes), filled in {fill_s:.1f} s")
    for r in rounds:
        print(f"  check {r['check_s'] * 1e3:8.1f} ms; longest health during it {r['max_wait_during_check_s'] * 1e3:7.1f}"
              f" ms ({r['pings_during_check']} answered)")
    print(f"worst round: a request waited {result['wait_vs_check']:.3f} of the check; health when idle "
          f"{result['health_idle_ms']:.2f} ms")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
