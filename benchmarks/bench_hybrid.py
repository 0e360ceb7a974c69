"""Sliding-window layers: bytes backed up and written to disk, and hits, against the same
model cached as if every layer were full attention.

A gpt-oss-like spec: 12 layers alternating sliding-window (``--window`` tokens) and full
attention, 4 KV heads x 64, bf16, page 16 (192 KiB a page). One synthetic trace runs
through a tier manager twice — with that spec, and with the same layers without their
windows ("full"), everything else equal — with an engine that matches each prompt but
its last token, loads the hit, computes the rest and inserts prompt and answer, on a
device pool and a host pool small enough that pages go to host and disk (LMDB in a
temporary directory), write-through to both; transfers settle after each request, so
that the two runs evict alike whatever the copy and writer threads' timing.

The trace: ``--conversations`` conversations, each on one of a few shared system
prompts, ``--turns`` turns each (a user message, an answer), interleaved; a turn is
sometimes regenerated (the same history, another user message: a branch at the end of
the previous turn). The engine offers the system prompt's end as one of each insert's
``ends`` (where other conversations branch off: it knows its chat template; a turn's end
is an insert's end, a node end anyway). Every
request's hit is counted in both runs: ``hits_lost_tokens`` is what the window-cut cache
hit less than the full one, request by request; a third run without ``ends``
(``hits_lost_tokens_without_ends``) shows what a branch found only once its pages left
the device costs.

    python benchmarks/bench_hybrid.py [--conversations 24] [--turns 4] [--window 128] [--json]

With ``--json`` the last line is one JSON object: ``swa_bytes_written`` and
``full_bytes_written`` (host -> disk), ``swa_saving`` (1 - their ratio), the same for
backups (``*_bytes_backed_up``, ``backup_saving``), ``hit_tokens_swa``,
``hit_tokens_full``, ``hits_lost_tokens``, and the figures of the setup.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time

import numpy as np

from hicache.engine.kv_pool import export_kv_pool
from hicache.keys import namespace_id
from hicache.spec import KVSpec, MHALayer
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierConfig, TierManager

PAGE = 16
SYSTEM_PROMPTS = 4
SYSTEM_TOKENS = 1024


def specs(window: int) -> tuple[KVSpec, KVSpec]:
    def layers(w: int):
        return tuple(MHALayer(num_kv_heads=4, head_dim=64, dtype="bfloat16", sliding_window=w if i % 2 == 0 else 0)
                     for i in range(12))

    return (KVSpec(page_size=PAGE, layers=layers(window), model="bench-hybrid"),
            KVSpec(page_size=PAGE, layers=layers(0), model="bench-hybrid"))


def trace(conversations: int, turns: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Requests in order: (prompt, answer) tokens (every prompt opens with a system
    prompt of ``SYSTEM_TOKENS``)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 50_000, SYSTEM_TOKENS).tolist() for _ in range(SYSTEM_PROMPTS)]
    history = [list(systems[c % SYSTEM_PROMPTS]) for c in range(conversations)]
    out = []
    for _ in range(turns):
        for c in range(conversations):
            user = rng.integers(0, 50_000, int(rng.integers(64, 257))).tolist()
            answer = rng.integers(0, 50_000, int(rng.integers(64, 129))).tolist()
            if rng.random() < 0.3 and len(history[c]) > SYSTEM_TOKENS:  # regenerate: a branch
                other = rng.integers(0, 50_000, int(rng.integers(64, 257))).tolist()
                out.append((history[c] + other, answer))
            out.append((history[c] + user, answer))
            history[c] = history[c] + user + answer
    return out


def run(spec: KVSpec, requests, *, device_pages: int, host_pages: int, disk_bytes: int, ends: bool = True) -> dict:
    directory = tempfile.mkdtemp(prefix="hicache-bench-hybrid-")
    exported = export_kv_pool(spec, device_pages)
    store = LmdbBackend(directory, capacity_bytes=disk_bytes)
    tm = TierManager(spec, host_pages=host_pages, storage=store,
                     config=TierConfig(write_policy="write_through", disk_policy="write_through"))
    ns = namespace_id(spec.fingerprint, "bench")
    tm.add_namespace(ns)
    tm.register_pool(0, [exported.pool])
    hits = []
    started = time.perf_counter()
    try:
        for prompt, answer in requests:
            with_kv = prompt + answer[:-1]  # (the last token generated gets no K / V)
            hit = tm.match(ns, prompt[:-1], 0).match  # (the last prompt token is computed)
            node = hit.node
            tm.lock(node, 0)
            prefix = np.empty(0, np.int32)
            if node.parent is not None:
                loaded = tm.wait(tm.load(node, 0))
                prefix = loaded.device_pages
            hits.append(len(prefix) * PAGE)
            full = len(with_kv) // PAGE
            new = tm.alloc(0, full - len(prefix))
            if new is None:
                raise RuntimeError("the device pool cannot hold one request: raise --device-pages")
            offered = [SYSTEM_TOKENS // PAGE] if ends and SYSTEM_TOKENS // PAGE <= full else []
            tm.insert(ns, with_kv[: full * PAGE], 0, np.concatenate((prefix, new)).astype(np.int32), ends=offered)
            tm.unlock(node, 0)
            tm.flush()  # (settled after every request: both runs evict alike, whatever the threads' timing)
        tm.flush()
        tm.check_invariants()
        moved = dict(tm._core.moved)
        stats = store.stats()
    finally:
        tm.close()
        store.close()
        exported.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {"hits": hits, "backed_up": moved.get("d2h", 0), "written": moved.get("host_to_disk", 0),
            "stored_bytes": stats.bytes, "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--device-pages", type=int, default=768)
    parser.add_argument("--host-pages", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    swa_spec, full_spec = specs(args.window)
    requests = trace(args.conversations, args.turns, args.seed)
    disk_bytes = 4 << 30
    common = dict(device_pages=args.device_pages, host_pages=args.host_pages, disk_bytes=disk_bytes)
    full = run(full_spec, requests, **common)
    swa = run(swa_spec, requests, **common)
    bare = run(swa_spec, requests, **common, ends=False)
    lost = sum(max(0, f - s) for f, s in zip(full["hits"], swa["hits"]))
    lost_bare = sum(max(0, f - s) for f, s in zip(full["hits"], bare["hits"]))
    figures = {
        "requests": len(requests), "window": args.window, "window_pages": swa_spec.window_pages,
        "page_bytes": swa_spec.host_page_bytes, "kept_page_bytes": swa_spec.kept_page_bytes,
        "full_bytes_backed_up": full["backed_up"], "swa_bytes_backed_up": swa["backed_up"],
        "backup_saving": round(1 - swa["backed_up"] / full["backed_up"], 4),
        "full_bytes_written": full["written"], "swa_bytes_written": swa["written"],
        "swa_saving": round(1 - swa["written"] / full["written"], 4),
        "full_disk_bytes": full["stored_bytes"], "swa_disk_bytes": swa["stored_bytes"],
        "hit_tokens_full": sum(full["hits"]), "hit_tokens_swa": sum(swa["hits"]), "hits_lost_tokens": lost,
        "hits_lost_tokens_without_ends": lost_bare, "swa_bytes_written_without_ends": bare["written"],
        "full_seconds": round(full["seconds"], 2), "swa_seconds": round(swa["seconds"], 2),
    }
    print(f"{len(requests)} requests, window {args.window} tokens ({swa_spec.window_pages} pages), "
          f"{swa_spec.host_page_bytes // 1024} KiB pages ({swa_spec.kept_page_bytes // 1024} KiB without SWA)")
    print(f"{'':24}{'full':>16}{'swa':>16}{'swa / full':>12}")
    for label, key in (("bytes backed up", "bytes_backed_up"), ("bytes written to disk", "bytes_written"),
                       ("bytes on disk", "disk_bytes")):
        f, s = figures[f"full_{key}"], figures[f"swa_{key}"]
        print(f"{label:24}{f:>16,}{s:>16,}{s / f:>12.3f}")
    print(f"{'hit tokens':24}{figures['hit_tokens_full']:>16,}{figures['hit_tokens_swa']:>16,}"
          f"{figures['hit_tokens_swa'] / max(1, figures['hit_tokens_full']):>12.3f}")
    print(f"hit tokens lost to the window, request by request: {lost} ({lost_bare} without the engine's ends, "
          f"{bare['written']:,} bytes written then)")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
