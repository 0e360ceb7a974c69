"""Scale benchmark: a production-shaped trace through a real daemon, against flat LRUs.

A synthetic trace with the shape of a public production conversation trace (long
system prompts shared by many conversations, Zipf-popular; multi-turn conversations
whose prompts grow to 100 k tokens; pasted documents make most turns long; one
conversation going on per 500 unique pages, taking turns at random, so that a
conversation's next turn comes after many others' — reuse distances that reach past the
host tier and the disk tier), pages of 64
tokens, a tiny KV spec (1 layer, 1 head, head_dim 8: 2 KiB a page) so that bytes are
small and the tiers' bookkeeping is what is measured. Tier sizes are fractions of the
trace's unique pages: device (the engine's pool) 5 %, host 20 %, disk 50 %.

* **hicache** — ``hicache serve`` in its own process (write-through to host and disk, the
  default policies; metrics on); one engine runs every request's lifecycle through the
  client: match, lock, load (wait for its layers), alloc the rest of prompt + reply
  (retried while the daemon answers "no pages yet": backpressure), insert, unlock.
  Tokens saved = pages the load delivered (never the prompt's last token).
* **flat LRU, total** — one LRU of device + host + disk pages, as if the tiers were one
  exclusive cache; **flat LRU, disk** — one LRU the size of the disk tier (what an
  inclusive hierarchy can at best hold). Both evict leaves first (a prefix cache) and
  are simulated in the same run on the same requests.

Figures: requests/s; p50 / p99 / max round trip per op; tokens saved and their ratio to
each LRU; pages a match reported that the load did not deliver (short); backups and
disk writes deferred; pages that left the cache from device or host — lost, under
write-through; bytes of daemon memory per cached page: the growth of its anonymous RSS
from a warm daemon — the first time 99 % of the host pool is in use (imports and
start-up done, the pool resident) — to the end, over the pages the tree gained meanwhile
(``bytes_per_page_from_start`` keeps the cruder figure: RSS growth since register less
the whole host pool, over the pages in the tree at the end).

With ``--exclusive`` the same trace runs through a second daemon with ``[tiers] capacity
= "exclusive"`` (``disk_policy = "write_back"``): host and disk hold different pages.
``--rate R`` paces the requests at R a second at most, as an engine's compute would (the
unpaced loop is far faster than any prefill: 68 requests/s here is ~1 M prompt tokens a
second); exclusive capacity puts disk writes on the eviction path, so it needs a writer
that keeps up with the pace.

    python benchmarks/bench_scale.py [--unique-pages N] [--seed S] [--repeat 2] [--exclusive] [--rate R] [--json]

``--json`` ends with one JSON object: ``saved_vs_flat_lru_total``,
``saved_vs_flat_lru_disk``, ``short_pages``, ``lost_backups``, ``max_trivial_op_ms``
(lock / unlock / health), ``p99_match_ms``, ``bytes_per_page``, ``requests_per_s``, the
raw figures, with ``--repeat 2`` ``saved_spread`` (relative difference in tokens
saved between the two runs), with ``--exclusive`` ``exclusive_saved_vs_flat_lru_total``,
``exclusive_short_pages``, ``exclusive_lost_backups`` and the run's figures.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import tempfile
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hicache.client import CacheClient
from hicache.daemon.spawn import start_daemon, stop_daemon
from hicache.engine.kv_pool import export_kv_pool
from hicache.spec import KVSpec

PAGE_SIZE = 64
SPEC = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=PAGE_SIZE, model="bench-scale")
MAX_PROMPT = 100_000
SYSTEM_PROMPTS = 40
ACTIVE_PER_PAGES = 500  # conversations going on at once: one per this many unique pages (2,000 for 1 M)
SYSTEM_TOKEN_BASE = 1_500_000_000  # system prompt tokens; conversation tokens count up from 1


@dataclass(frozen=True)
class Request:
    system: int  # which system prompt
    conversation: int
    prompt: int  # tokens after the system prompt, in the prompt
    reply: int  # tokens the reply adds (cached with the prompt at the end of the request)


@dataclass
class Trace:
    system_lengths: np.ndarray  # tokens (whole pages)
    conversation_base: list[int]  # first token id of each conversation's own stream
    requests: list[Request]
    unique_pages: int

    def tokens(self, r: Request, with_reply: bool) -> np.ndarray:
        system = self.system_lengths[r.system]
        start = SYSTEM_TOKEN_BASE + int(self.system_lengths[: r.system].sum())
        own = r.prompt + (r.reply if with_reply else 0)
        base = self.conversation_base[r.conversation]
        return np.concatenate((np.arange(start, start + system, dtype=np.int32),
                               np.arange(base, base + own, dtype=np.int32)))

    def page_ids(self, r: Request, num_pages: int) -> range | list[int]:
        """Ids of the first ``num_pages`` pages: a system prompt's pages are shared by its
        conversations, the rest are the conversation's own."""
        sys_pages = int(self.system_lengths[r.system]) // PAGE_SIZE
        sys_first = int(self.system_lengths[: r.system].sum()) // PAGE_SIZE
        shared = list(range(sys_first, sys_first + min(num_pages, sys_pages)))
        own_first = (1 << 40) + self.conversation_base[r.conversation]  # (a conversation's pages: its token base)
        return shared + list(range(own_first, own_first + max(0, num_pages - sys_pages)))


def make_trace(unique_pages: int, seed: int) -> Trace:
    """Requests until the trace has ``unique_pages`` distinct pages (see the module doc)."""
    rng = np.random.default_rng(seed)
    system_lengths = rng.integers(16, 129, SYSTEM_PROMPTS) * PAGE_SIZE  # 1 k .. 8 k tokens
    popularity = 1.0 / np.arange(1, SYSTEM_PROMPTS + 1) ** 1.1
    popularity /= popularity.sum()
    unique = int(system_lengths.sum()) // PAGE_SIZE
    requests: list[Request] = []
    bases: list[int] = []
    next_token = 1
    active: list[list[int]] = []  # [conversation, system, own tokens so far, turns left]

    def start() -> list[int]:
        nonlocal next_token
        bases.append(next_token)
        next_token += MAX_PROMPT + 8192  # room for the conversation's whole stream
        return [len(bases) - 1, int(rng.choice(SYSTEM_PROMPTS, p=popularity)), 0, int(rng.geometric(0.22))]

    concurrent = max(8, unique_pages // ACTIVE_PER_PAGES)
    while unique < unique_pages:
        while len(active) < concurrent:
            active.append(start())
        i = int(rng.integers(len(active)))
        conv, system, own, left = active[i]
        user = int(np.clip(rng.lognormal(7.6, 1.1), 50, 30_000))  # ~3 k median, long pasted documents
        reply = int(np.clip(rng.lognormal(6.0, 0.8), 20, 4_000))
        if int(system_lengths[system]) + own + user + reply > MAX_PROMPT:
            active.pop(i)
            continue
        requests.append(Request(system, conv, own + user, reply))
        before = own // PAGE_SIZE
        own += user + reply
        unique += own // PAGE_SIZE - before
        if left <= 1:
            active.pop(i)
        else:
            active[i] = [conv, system, own, left - 1]
    return Trace(system_lengths, bases, requests, unique)


def usable_pages(num_tokens: int) -> int:
    """Whole pages a request may take from the cache (its last token is computed)."""
    return (num_tokens - 1) // PAGE_SIZE


def flat_lru(trace: Trace, capacity: int) -> int:
    """Tokens saved by one LRU of ``capacity`` pages that evicts leaves first (pages are
    touched from the last to the first, so a prefix outlives its extensions)."""
    lru: OrderedDict[int, None] = OrderedDict()
    saved = 0
    for r in trace.requests:
        prompt_tokens = int(trace.system_lengths[r.system]) + r.prompt
        usable = usable_pages(prompt_tokens)
        whole = (prompt_tokens + r.reply) // PAGE_SIZE
        ids = trace.page_ids(r, whole)
        hit = 0
        while hit < usable and ids[hit] in lru:
            hit += 1
        saved += hit * PAGE_SIZE
        for page in reversed(ids):
            if page in lru:
                lru.move_to_end(page)
            else:
                lru[page] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    return saved


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("hicache_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def rss_anon(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) * 1024


class Timings:
    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def call(self, op: str, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.samples.setdefault(op, []).append(time.perf_counter() - start)
        return result

    def summary(self) -> dict[str, dict[str, float]]:
        return {op: {"p50_ms": float(np.percentile(v, 50)) * 1e3, "p99_ms": float(np.percentile(v, 99)) * 1e3,
                     "max_ms": max(v) * 1e3, "count": len(v)} for op, v in sorted(self.samples.items())}


EXCLUSIVE = '[tiers]\ncapacity = "exclusive"\ndisk_policy = "write_back"\n'


def run_hicache(trace: Trace, device_pages: int, host_pages: int, disk_pages: int, tiers: str = "",
                rate: float = 0.0) -> dict:
    """One run through a daemon; ``tiers``: its ``[tiers]`` section (default policies
    when empty); ``rate``: requests per second at most (0: as fast as it answers)."""
    directory = Path(tempfile.mkdtemp(prefix="hicache-scale-"))
    port = free_port()
    daemon = start_daemon(directory, (
        f'[server]\nsocket = "{directory / "hicache.sock"}"\n'
        f'[host]\nbytes = {host_pages * SPEC.host_page_bytes}\n'
        f'[disk]\npath = "{directory / "lmdb"}"\ncapacity_bytes = {disk_pages * SPEC.host_page_bytes}\n'
        f'[metrics]\nenabled = true\naddress = "127.0.0.1"\nport = {port}\n' + tiers
    ), name="bench_scale")
    kv = export_kv_pool(SPEC, device_pages)
    timings = Timings()
    saved = short = backpressure = 0
    try:
        client = CacheClient(f"ipc://{directory / 'hicache.sock'}", timeout_s=120.0)
        client.register(SPEC, [kv.handle])
        rss_start = rss_anon(daemon.pid)
        warm = None  # (anonymous RSS, cached pages) once (nearly) every host pool page has been used
        started = time.perf_counter()
        for n, r in enumerate(trace.requests):
            if rate:
                ahead = started + n / rate - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
            if warm is None and n % 64 == 32:
                (now,) = client.stats()["specs"].values()
                if now["host"]["free"] <= host_pages // 100:  # (at most 1 % of the pool never touched)
                    warm = (rss_anon(daemon.pid), int(now.get("pages", 0)))
            tokens = trace.tokens(r, with_reply=True)
            prompt_tokens = int(trace.system_lengths[r.system]) + r.prompt
            m = timings.call("match", client.match, tokens[:prompt_tokens])
            if m.handle is not None:
                timings.call("lock", client.lock, m.handle)
                loaded = timings.call("load", client.load, m.handle)
                for layer in range(SPEC.num_layers):
                    client.wait_layer(loaded.wait, layer, timeout_s=120)
                have = loaded.device_pages
            else:
                have = np.empty(0, dtype=np.int32)
            short += m.num_tokens // PAGE_SIZE - len(have)
            usable = min(len(have), usable_pages(prompt_tokens))
            saved += usable * PAGE_SIZE
            whole = len(tokens) // PAGE_SIZE
            new = timings.call("alloc", client.alloc, whole - usable)
            deadline = time.monotonic() + 120
            while new is None:  # the daemon's pages wait for room below: come back
                backpressure += 1
                if time.monotonic() > deadline:
                    raise SystemExit("bench_scale: the device pool never came back")
                time.sleep(0.002)
                new = timings.call("alloc", client.alloc, whole - usable)
            pages = np.concatenate((have[:usable], new))
            timings.call("insert", client.insert, tokens[: whole * PAGE_SIZE], pages)
            if m.handle is not None:
                timings.call("unlock", client.unlock, m.handle)
            if n % 64 == 0:
                timings.call("health", client.health)
        elapsed = time.perf_counter() - started
        flush_started = time.perf_counter()
        client.flush(timeout_s=600)
        flush_s = time.perf_counter() - flush_started
        stats = client.stats()
        metrics = scrape(port)
        rss_end = rss_anon(daemon.pid)
        client.close()
    finally:
        kv.close()
        stop_daemon(daemon, directory)
    (figures,) = stats["specs"].values()
    cached = int(figures.get("pages", 0))
    host_bytes = host_pages * SPEC.host_page_bytes
    marginal = float("nan")
    if warm is not None and cached > warm[1]:
        marginal = (rss_end - warm[0]) / (cached - warm[1])
    return {
        "saved_tokens": saved, "client_short_pages": short, "backpressure_waits": backpressure,
        "requests_per_s": len(trace.requests) / elapsed, "seconds": elapsed, "flush_s": flush_s,
        "ops": timings.summary(),
        "short_pages": metrics['hicache_load_short_tokens_total'] / PAGE_SIZE,
        "lost_backups": metrics['hicache_pages_dropped_total{tier="device"}']
        + metrics['hicache_pages_dropped_total{tier="host"}'],
        "backups_deferred": metrics["hicache_backups_deferred_total"],
        "disk_writes_deferred": metrics["hicache_disk_writes_deferred_total"],
        "matched_tokens": {t: metrics[f'hicache_matched_tokens_total{{tier="{t}"}}'] for t in ("device", "host", "disk")},
        "cached_pages": cached, "nodes": int(figures.get("nodes", 0)),
        "rss_growth_bytes": rss_end - rss_start,
        "bytes_per_page_from_start": (rss_end - rss_start - host_bytes) / cached if cached else float("nan"),
        "bytes_per_page": marginal,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unique-pages", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--repeat", type=int, default=1, choices=(1, 2), help="run hicache twice (saved_spread)")
    parser.add_argument("--exclusive", action="store_true",
                        help='also run with [tiers] capacity = "exclusive" (disk_policy = "write_back")')
    parser.add_argument("--rate", type=float, default=0.0,
                        help="requests per second at most, as an engine's compute would pace them (0: no limit)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    trace = make_trace(args.unique_pages, args.seed)
    device = max(2 * MAX_PROMPT // PAGE_SIZE, trace.unique_pages * 5 // 100)
    host = trace.unique_pages * 20 // 100
    disk = trace.unique_pages * 50 // 100
    prompt_tokens = sum(int(trace.system_lengths[r.system]) + r.prompt for r in trace.requests)
    print(f"trace: {len(trace.requests)} requests, {prompt_tokens / 1e6:.1f} M prompt tokens, "
          f"{trace.unique_pages} unique pages; device {device}, host {host}, disk {disk} pages", flush=True)
    lru_total = flat_lru(trace, device + host + disk)
    lru_disk = flat_lru(trace, disk)
    infinite = flat_lru(trace, 1 << 62)
    print(f"flat LRU saved: total-size {lru_total}, disk-size {lru_disk}, infinite {infinite} tokens", flush=True)
    runs = []
    for _ in range(args.repeat):
        runs.append(run_hicache(trace, device, host, disk, rate=args.rate))
        print(f"run {len(runs)}: saved {runs[-1]['saved_tokens']} tokens, {runs[-1]['requests_per_s']:.1f} "
              f"requests/s", flush=True)
    ours = runs[0]
    trivial = max(ours["ops"][op]["max_ms"] for op in ("lock", "unlock", "health") if op in ours["ops"])
    result = {
        "requests": len(trace.requests), "prompt_tokens": prompt_tokens, "unique_pages": trace.unique_pages,
        "device_pages": device, "host_pages": host, "disk_pages": disk,
        "saved_tokens": ours["saved_tokens"], "flat_lru_total_saved": lru_total, "flat_lru_disk_saved": lru_disk,
        "infinite_saved": infinite,
        "saved_vs_flat_lru_total": ours["saved_tokens"] / lru_total if lru_total else float("nan"),
        "saved_vs_flat_lru_disk": ours["saved_tokens"] / lru_disk if lru_disk else float("nan"),
        "short_pages": ours["short_pages"], "lost_backups": ours["lost_backups"],
        "max_trivial_op_ms": trivial, "p99_match_ms": ours["ops"]["match"]["p99_ms"],
        "bytes_per_page": ours["bytes_per_page"], "requests_per_s": ours["requests_per_s"],
        "hicache": ours,
    }
    if len(runs) == 2:
        a, b = runs[0]["saved_tokens"], runs[1]["saved_tokens"]
        result["saved_spread"] = abs(a - b) / max(a, b, 1)
        result["second_run"] = runs[1]
    if args.exclusive:
        exclusive = run_hicache(trace, device, host, disk, EXCLUSIVE, rate=args.rate)
        result["exclusive"] = exclusive
        result["exclusive_saved_vs_flat_lru_total"] = exclusive["saved_tokens"] / lru_total if lru_total else float("nan")
        result["exclusive_short_pages"] = exclusive["short_pages"]
        result["exclusive_lost_backups"] = exclusive["lost_backups"]
    for op, s in ours["ops"].items():
        print(f"  {op:7s} p50 {s['p50_ms']:8.3f} ms  p99 {s['p99_ms']:8.3f} ms  max {s['max_ms']:8.1f} ms  "
              f"({s['count']})")
    print(f"hicache saved {ours['saved_tokens']} tokens: {result['saved_vs_flat_lru_total']:.3f} of a flat LRU "
          f"of all tiers, {result['saved_vs_flat_lru_disk']:.3f} of one of the disk tier; "
          f"{ours['requests_per_s']:.1f} requests/s; short {ours['short_pages']:.0f} pages, lost "
          f"{ours['lost_backups']:.0f}; deferred: {ours['backups_deferred']:.0f} backups, "
          f"{ours['disk_writes_deferred']:.0f} disk writes; {ours['bytes_per_page']:.0f} B per cached page "
          f"({ours['cached_pages']} pages, {ours['nodes']} nodes); flush {ours['flush_s']:.1f} s", flush=True)
    if "saved_spread" in result:
        print(f"two runs: tokens saved differ by {100 * result['saved_spread']:.3f} %")
    if args.exclusive:
        e = result["exclusive"]
        print(f"exclusive capacity: saved {e['saved_tokens']} tokens: "
              f"{result['exclusive_saved_vs_flat_lru_total']:.3f} of a flat LRU of all tiers; "
              f"{e['requests_per_s']:.1f} requests/s; short {e['short_pages']:.0f} pages, lost "
              f"{e['lost_backups']:.0f}; deferred: {e['backups_deferred']:.0f} backups, "
              f"{e['disk_writes_deferred']:.0f} disk writes; flush {e['flush_s']:.1f} s", flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
