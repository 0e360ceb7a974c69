"""Tree benchmark: insert and match cost of hicache.tree on the multi-turn workload.

Replays ``workloads.multi_turn`` the way an engine drives the tree: before each insert
it matches the sequence (untimed) to reuse the cached prefix pages, allocates fresh
pages for the rest, then inserts (timed) and frees any duplicates. Then it times the
10,000 lookups. Tokens are passed packed (little-endian int32 bytes), as they arrive on
the wire.

    python benchmarks/bench_tree.py --page-size 16 [--json]

Prints a table; with ``--json`` the last line is one JSON object with ``insert_us``,
``match_us`` (mean per call), ``hit_tokens_per_lookup``, the same for the baseline tree
(the classic per-token Python radix cache, ``baseline_radix.py``) and the ratios
baseline / hicache (``baseline_insert_speedup``, ``baseline_match_speedup``). ``--sglang`` adds SGLang's
own Python ``RadixCache`` when the ``sglang`` package is importable.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_radix import BaselineRadixTree  # noqa: E402
from workloads import multi_turn, packed  # noqa: E402

from hicache.keys import namespace_id  # noqa: E402
from hicache.pages import PageAllocator  # noqa: E402
from hicache.tree import HiRadixTree  # noqa: E402

POOL = 0


def run_hicache(workload, page_size: int) -> dict[str, float]:
    inserts = packed(workload.inserts)
    lookups = packed(workload.lookups)
    namespace = namespace_id(b"bench-model", None)
    tree = HiRadixTree()
    tree.add_namespace(namespace, page_size)
    total_pages = sum(len(s) // page_size for s in workload.inserts)
    allocator = PageAllocator.for_device(total_pages)

    insert_ns = 0
    # Settle start-up garbage first, as a long-running daemon has: otherwise the first
    # full collection (walking every object torch and numpy created at import) lands
    # inside the timed region.
    gc.collect()
    for tokens in inserts:
        num_pages = len(tokens) // (4 * page_size)
        prefix = tree.match(namespace, tokens, POOL).device_pages
        fresh = allocator.alloc(num_pages - len(prefix))
        pages = np.concatenate((prefix, fresh))
        start = time.perf_counter_ns()
        result = tree.insert(namespace, tokens, POOL, pages)
        insert_ns += time.perf_counter_ns() - start
        allocator.free(result.duplicate_pages)

    hit_tokens = 0
    start = time.perf_counter_ns()
    for tokens in lookups:
        hit_tokens += tree.match(namespace, tokens, POOL).num_pages
    match_ns = time.perf_counter_ns() - start
    tree.check_invariants()
    allocator.check_invariants()
    return {
        "insert_us": insert_ns / len(inserts) / 1e3,
        "match_us": match_ns / len(lookups) / 1e3,
        "hit_tokens_per_lookup": hit_tokens * page_size / len(lookups),
        "nodes": len(tree),
    }


def run_baseline(workload, page_size: int) -> dict[str, float]:
    """The classic per-token Python radix tree of baseline_radix.py."""
    import torch

    inserts = [s.tolist() for s in workload.inserts]
    lookups = [s.tolist() for s in workload.lookups]
    tree = BaselineRadixTree(page_size)
    next_slot = 0
    insert_ns = 0
    gc.collect()
    for tokens in inserts:
        aligned = len(tokens) // page_size * page_size
        prefix, _ = tree.match_prefix(tokens)
        fresh = torch.arange(next_slot, next_slot + aligned - len(prefix), dtype=torch.int64)
        next_slot += len(fresh)
        values = torch.cat((prefix, fresh))
        start = time.perf_counter_ns()
        tree.insert(tokens[:aligned], values)
        insert_ns += time.perf_counter_ns() - start

    hit_tokens = 0
    start = time.perf_counter_ns()
    for tokens in lookups:
        hit_tokens += len(tree.match_prefix(tokens)[0])
    match_ns = time.perf_counter_ns() - start
    return {
        "insert_us": insert_ns / len(inserts) / 1e3,
        "match_us": match_ns / len(lookups) / 1e3,
        "hit_tokens_per_lookup": hit_tokens / len(lookups),
    }


def run_sglang(workload, page_size: int) -> dict[str, float]:
    """SGLang's own Python RadixCache, when the ``sglang`` package is importable.

    Tokens are handed over as ``array('q')`` (its key type), built before timing; a
    timed match includes ``path_device_indices`` so that both trees return the slot
    indices of the hit, as hicache's match does.
    """
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    cache = RadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=page_size))
    inserts = [array("q", s.tolist()) for s in workload.inserts]
    lookups = [array("q", s.tolist()) for s in workload.lookups]
    next_slot = 0
    insert_ns = 0
    gc.collect()
    for tokens in inserts:
        aligned = len(tokens) // page_size * page_size
        hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        prefix = cache.path_device_indices(hit.last_device_node)
        fresh = torch.arange(next_slot, next_slot + aligned - len(prefix), dtype=torch.int64)
        next_slot += len(fresh)
        values = torch.cat((prefix.to(torch.int64), fresh))
        start = time.perf_counter_ns()
        cache.insert(InsertParams(key=RadixKey(tokens), value=values))
        insert_ns += time.perf_counter_ns() - start

    hit_tokens = 0
    start = time.perf_counter_ns()
    for tokens in lookups:
        hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        hit_tokens += len(cache.path_device_indices(hit.last_device_node))
    match_ns = time.perf_counter_ns() - start
    return {
        "insert_us": insert_ns / len(inserts) / 1e3,
        "match_us": match_ns / len(lookups) / 1e3,
        "hit_tokens_per_lookup": hit_tokens / len(lookups),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline tree")
    parser.add_argument("--sglang", action="store_true",
                        help="also run SGLang's own RadixCache (needs the sglang package)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    args = parser.parse_args(argv)

    workload = multi_turn(args.seed)
    ours = run_hicache(workload, args.page_size)
    figures = {
        "page_size": args.page_size,
        "seed": args.seed,
        "inserts": len(workload.inserts),
        "lookups": len(workload.lookups),
        **ours,
    }
    rows = [("hicache.tree", ours)]
    others = [] if args.no_baseline else [("baseline", "baseline (per-token radix)", run_baseline)]
    if args.sglang:
        others.append(("sglang", "sglang RadixCache (python)", run_sglang))
    for prefix, label, run in others:
        theirs = run(workload, args.page_size)
        if theirs["hit_tokens_per_lookup"] != ours["hit_tokens_per_lookup"]:
            raise SystemExit(f"{label} and hicache disagree on hits: {theirs} vs {ours}")
        figures.update({
            f"{prefix}_insert_us": theirs["insert_us"],
            f"{prefix}_match_us": theirs["match_us"],
            f"{prefix}_insert_speedup": theirs["insert_us"] / ours["insert_us"],
            f"{prefix}_match_speedup": theirs["match_us"] / ours["match_us"],
        })
        rows.append((label, theirs))

    print(f"workload: seed {args.seed}, {len(workload.inserts)} inserts, "
          f"{len(workload.lookups)} lookups, page size {args.page_size}")
    print(f"{'tree':28} {'insert_us':>10} {'match_us':>10} {'hit tok/lookup':>15}")
    for name, row in rows:
        print(f"{name:28} {row['insert_us']:10.2f} {row['match_us']:10.2f} {row['hit_tokens_per_lookup']:15.1f}")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
