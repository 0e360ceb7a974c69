"""How long one hostile insert holds the owner thread: the largest lists one message may
carry (``MAX_CHECKPOINTS`` checkpoints or ends) through a tier manager in-process.

Three cases, each the time of the owner thread's calls (not the copies' threads):

* ``checkpoints``: a hybrid spec (a state layer and an MHA layer, page size 1) with
  ``--host-slots`` host checkpoint slots; ``--rounds`` inserts of ``--checkpoints`` pages
  each offer a checkpoint after every page. Once the slots are full, every checkpoint of
  an offer evicts one. Per round: the insert, the offer (``checkpoint``), and its
  completion (the wait, its done callback included).
* ``swa_top_up``: an SWA spec, a node of ``--checkpoints`` pages backed up, inserted
  again with an end after every page: the poll that starts the new ends' top-ups.
* ``ends``: a plain spec of page size ``--page-size``; one insert of ``--checkpoints``
  pages with an end after every page, and the same insert without ends.

    python benchmarks/bench_stall.py [--host-slots 4096] [--checkpoints 4096] [--rounds 3]
                                     [--page-size 256] [--json]

Collections of the garbage collector are left out (``gc.disable()`` while timing): the
daemon schedules them itself (``daemon/collector.py``). With ``--json`` the last line is
one JSON object: ``checkpoints`` (a list of rounds: ``insert_ms``, ``offer_ms``,
``done_ms``, ``taken``), ``swa_top_up_max_poll_ms``, ``swa_topped_up``,
``ends_insert_ms``, ``no_ends_insert_ms``, ``offer_vs_insert_ratio`` (the worst round's
offer and completion over its insert of the same pages: the baseline) and
``ends_vs_plain_ratio`` (the insert with ends over the one without), and the figures of
the setup.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from hicache.engine.kv_pool import export_kv_pool
from hicache.keys import namespace_id
from hicache.spec import KVSpec, MHALayer, StateLayer
from hicache.tiers import TierConfig, TierManager


def _manager(spec: KVSpec, num_pages: int, host_pages: int, **config):
    ns = namespace_id(spec.fingerprint, "bench-stall")
    exported = export_kv_pool(spec, num_pages, **({"num_state_slots": 8} if spec.state_bytes else {}))
    tm = TierManager(spec, host_pages=host_pages, config=TierConfig(**config))
    tm.add_namespace(ns)
    tm.register_pool(0, [exported.pool])
    return tm, ns, exported


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def bench_checkpoints(host_slots: int, n: int, rounds: int) -> list[dict]:
    spec = KVSpec(page_size=1, model="bench-stall-hybrid", layers=(
        StateLayer(conv_state_shape=(1, 4), temporal_state_shape=(1, 2, 2), conv_dtype="float32"),
        MHALayer(num_kv_heads=1, head_dim=4, dtype="float16")))
    tm, ns, exported = _manager(spec, n * (rounds + 1) + 8, 64, host_checkpoints=host_slots)
    out = []
    for r in range(rounds):
        toks = [10_000_000 * (r + 1) + i for i in range(n)]
        pages = tm.alloc(0, n)
        offers = [(i + 1, 1 + i % 7) for i in range(n)]
        t0 = time.perf_counter()
        node = tm.insert(ns, toks, 0, pages, ends=[pages for pages, _ in offers]).node
        t1 = time.perf_counter()
        future = tm.checkpoint(node, 0, offers)
        t2 = time.perf_counter()
        taken = tm.wait(future)
        t3 = time.perf_counter()
        out.append({"insert_ms": _ms(t1 - t0), "offer_ms": _ms(t2 - t1), "done_ms": _ms(t3 - t2), "taken": taken})
    tm.check_invariants()
    tm.close()
    exported.close()
    return out


def bench_swa_top_up(n: int) -> tuple[float, int]:
    spec = KVSpec(page_size=1, model="bench-stall-swa", layers=(
        MHALayer(num_kv_heads=1, head_dim=4, sliding_window=2), MHALayer(num_kv_heads=1, head_dim=4)))
    tm, ns, exported = _manager(spec, n + 8, n + 8)
    toks = list(range(1000, 1000 + n))
    tm.insert(ns, toks, 0, tm.alloc(0, n))
    tm.flush()
    hit = tm.match(ns, toks, 0).match
    tm.insert(ns, toks, 0, hit.device_pages, ends=list(range(1, n + 1)))
    worst = 0.0
    while tm.windows.split or tm.windows.busy:
        t0 = time.perf_counter()
        tm.poll(0.01)
        worst = max(worst, time.perf_counter() - t0)
    topped_up = tm.windows.topped_up
    tm.check_invariants()
    tm.close()
    exported.close()
    return _ms(worst), topped_up


def bench_ends(page_size: int, n: int) -> tuple[float, float]:
    spec = KVSpec(page_size=page_size, model="bench-stall-ends", layers=(MHALayer(num_kv_heads=1, head_dim=4),))
    times = []
    for ends in (list(range(1, n + 1)), []):
        tm, ns, exported = _manager(spec, n + 8, 64, write_policy="write_back")
        toks = list(range(1000, 1000 + n * page_size))
        pages = tm.alloc(0, n)
        t0 = time.perf_counter()
        tm.insert(ns, toks, 0, pages, ends=ends)
        times.append(_ms(time.perf_counter() - t0))
        tm.close()
        exported.close()
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-slots", type=int, default=4096)
    parser.add_argument("--checkpoints", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    gc.disable()
    rounds = bench_checkpoints(args.host_slots, args.checkpoints, args.rounds)
    worst_poll, topped_up = bench_swa_top_up(args.checkpoints)
    with_ends, without_ends = bench_ends(args.page_size, args.checkpoints)
    gc.enable()
    for i, r in enumerate(rounds):
        print(f"checkpoints round {i}: insert {r['insert_ms']} ms, offer {r['offer_ms']} ms, "
              f"done {r['done_ms']} ms, taken {r['taken']}")
    print(f"swa top-up: worst poll {worst_poll} ms, {topped_up} ends topped up")
    print(f"ends: insert {with_ends} ms with an end after every page, {without_ends} ms without")
    # The baseline: the same pages inserted without the hostile list (what any insert of
    # that size costs); the ratios say what the list adds on the owner thread.
    worst = max(rounds, key=lambda r: r["offer_ms"] + r["done_ms"])
    offer_ratio = round((worst["offer_ms"] + worst["done_ms"]) / max(worst["insert_ms"], 1e-3), 2)
    ends_ratio = round(with_ends / max(without_ends, 1e-3), 2)
    print(f"worst offer + completion {offer_ratio}x its insert; an insert with ends {ends_ratio}x one without")
    if args.json:
        print(json.dumps({"host_slots": args.host_slots, "checkpoints_per_insert": args.checkpoints,
                          "page_size": args.page_size, "checkpoints": rounds,
                          "swa_top_up_max_poll_ms": worst_poll, "swa_topped_up": topped_up,
                          "ends_insert_ms": with_ends, "no_ends_insert_ms": without_ends,
                          "offer_vs_insert_ratio": offer_ratio, "ends_vs_plain_ratio": ends_ratio}))


if __name__ == "__main__":
    main()
