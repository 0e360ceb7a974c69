"""Ranks benchmark: what a hit costs an engine's scheduler under tensor parallelism.

An engine at TP n keeps one engine-owned pool per rank (vLLM's connector: each rank's
worker registers its shard), and its scheduler a session on each: a hit is a ``match``
on every rank, then a ``load_into`` on every rank, all on vLLM's scheduler loop. In one
run, against ``hicache serve`` in its own process (default configuration, disk off), at
TP 1, 2, 4 and 8, rounds alternating between:

* one by one (the baseline: what the connector did before) — each rank's ``match``,
  then each rank's ``load_into``, one round trip after another;
* at once — ``match_each`` then ``load_into_each`` (:mod:`hicache.client`): every
  rank's request sent before any answer is read.

Each round is one hit of a 2,000-token prompt (125 pages of 16 tokens, 4 layers) whose
pages are in the host tier, loaded into the worker's blocks without a lock held (as
the connector loads); the workers (in this process) wait for the last layer after the
round, outside the time taken. Medians over ``--rounds`` rounds of each.

    python benchmarks/bench_ranks.py [--rounds 200] [--json]

With ``--json`` the last line is one JSON object with, for each TP n in 1, 2, 4, 8:
``tp<n>_match_seq_us``, ``tp<n>_match_each_us``, ``tp<n>_match_speedup`` (one by one
over at once), ``tp<n>_hit_seq_us``, ``tp<n>_hit_each_us`` and ``tp<n>_hit_speedup``
(match and load start together).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TOKENS = 2000
PAGE_SIZE = 16
LAYERS = 4
TP_SIZES = (1, 2, 4, 8)


def rank_layout(rank: int, tp: int, num_blocks: int):
    """Rank ``rank``'s pool: vLLM's CPU layout (one allocation, each layer's blocks one
    run), its shard in the spec's layout as the connector names it."""
    from hicache.foreign import Allocation, ForeignLayout
    from hicache.spec import KVSpec

    spec = KVSpec.mha(num_layers=LAYERS, num_kv_heads=2, head_dim=64, page_size=PAGE_SIZE, dtype="bfloat16",
                      model="bench-ranks", layout=f"bench/ranks/tp{rank}of{tp}")
    block = spec.page_bytes(0)
    return ForeignLayout(spec, num_blocks, block, (
        Allocation(LAYERS * num_blocks * block, tuple(range(LAYERS)), num_blocks * block, block, 0),))


class Engine:
    """TP ``tp``: a worker per rank (its pool registered, the prompt stored from it) and
    the scheduler's session on each rank's pool."""

    def __init__(self, endpoint: str, tp: int, tokens: list[int]) -> None:
        from hicache.client import CacheClient
        from hicache.engine.kv_pool import export_owned_pool

        pages = len(tokens) // PAGE_SIZE
        self.workers, self.exported, self.schedulers = [], [], []
        for rank in range(tp):
            layout = rank_layout(rank, tp, 2 * pages + 1)
            exported = export_owned_pool(layout, name=f"bench-tp{tp}-rank{rank}")
            self.exported.append(exported)
            for tensor in exported.tensors:
                tensor.numpy()[:] = np.random.default_rng(rank).integers(0, 256, tensor.numel(), dtype=np.uint8)
            worker = CacheClient(endpoint)
            worker.register_owned(layout.spec, exported.handle)
            self.workers.append(worker)
            stored = worker.store(tokens, list(range(1, pages + 1)))
            if stored.num_cached != pages:
                raise SystemExit(f"bench_ranks: rank {rank} cached {stored.num_cached} of {pages} pages")
            scheduler = CacheClient(endpoint)
            scheduler.attach(f"bench-tp{tp}-rank{rank}")
            self.schedulers.append(scheduler)
        self.blocks = list(range(pages + 1, 2 * pages + 1))  # (where hits land)

    def wait(self, loads) -> None:
        """Each worker waits for its load's last layer."""
        for worker, done in zip(self.workers, loads, strict=True):
            worker.wait_layer(done.wait, LAYERS - 1, timeout_s=60)

    def close(self) -> None:
        for client in self.schedulers + self.workers:
            client.close()
        for exported in self.exported:
            exported.close()


def one_by_one(engine: Engine, tokens: list[int]) -> tuple[float, float, list]:
    t0 = time.perf_counter()
    matches = [c.match(tokens) for c in engine.schedulers]
    t1 = time.perf_counter()
    loads = [c.load_into(m.handle, engine.blocks, locked=False) for c, m in zip(engine.schedulers, matches)]
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, loads


def at_once(engine: Engine, tokens: list[int]) -> tuple[float, float, list]:
    from hicache.client import load_into_each, match_each

    t0 = time.perf_counter()
    matches = match_each(engine.schedulers, tokens)
    t1 = time.perf_counter()
    loads = load_into_each(engine.schedulers, [m.handle for m in matches], engine.blocks, locked=False)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, loads


def run_tp(endpoint: str, tp: int, rounds: int) -> dict[str, float]:
    tokens = list(range(1_000 * tp, 1_000 * tp + TOKENS))
    engine = Engine(endpoint, tp, tokens)
    samples: dict[str, list[float]] = {"match_seq": [], "hit_seq": [], "match_each": [], "hit_each": []}
    try:
        for i in range(rounds + 10):  # (the first ten: warm-up)
            for name, way in (("seq", one_by_one), ("each", at_once)) if i % 2 else (("each", at_once),
                                                                                     ("seq", one_by_one)):
                match_s, hit_s, loads = way(engine, tokens)
                if any(isinstance(d, Exception) or d.num_loaded_pages != len(engine.blocks) for d in loads):
                    raise SystemExit(f"bench_ranks: a load at TP {tp} fell short: {loads}")
                engine.wait(loads)
                if i >= 10:
                    samples[f"match_{name}"].append(match_s)
                    samples[f"hit_{name}"].append(hit_s)
    finally:
        engine.close()
    out = {f"tp{tp}_{k}_us": statistics.median(v) * 1e6 for k, v in samples.items()}
    for what in ("match", "hit"):
        out[f"tp{tp}_{what}_speedup"] = out[f"tp{tp}_{what}_seq_us"] / out[f"tp{tp}_{what}_each_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from hicache.daemon.spawn import start_daemon, stop_daemon

    directory = Path(tempfile.mkdtemp(prefix="hicache-bench-ranks-"))
    pages = TOKENS // PAGE_SIZE
    host_bytes = 2 * sum(TP_SIZES) * pages * rank_layout(0, 1, 2).spec.host_page_bytes
    daemon = start_daemon(directory, f'[server]\nsocket = "{directory / "hicache.sock"}"\n[disk]\nenabled = false\n'
                                     f'[metrics]\nport = 0\n[host]\nbytes = {host_bytes}\n', name="bench_ranks")
    endpoint = f"ipc://{directory / 'hicache.sock'}"
    figures: dict[str, float] = {"tokens": TOKENS, "pages": pages, "layers": LAYERS, "rounds": args.rounds}
    try:
        for tp in TP_SIZES:
            figures.update(run_tp(endpoint, tp, args.rounds))
    finally:
        stop_daemon(daemon, directory, 30)

    print(f"a {TOKENS:,}-token hit ({pages} pages) on every TP rank's pool, scheduler side, "
          f"medians of {args.rounds}, {os.cpu_count()} cores")
    print(f"{'TP':>3} {'match: 1 by 1':>14} {'at once':>9} {'':>7} {'hit: 1 by 1':>12} {'at once':>9}")
    for tp in TP_SIZES:
        f = {k.removeprefix(f"tp{tp}_"): v for k, v in figures.items() if k.startswith(f"tp{tp}_")}
        print(f"{tp:>3} {f['match_seq_us']:11.0f} us {f['match_each_us']:6.0f} us {f['match_speedup']:5.2f}x "
              f"{f['hit_seq_us']:9.0f} us {f['hit_each_us']:6.0f} us {f['hit_speedup']:5.2f}x")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
