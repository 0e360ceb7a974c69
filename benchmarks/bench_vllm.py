"""Time to first token with real vLLM engines (the CPU wheel): hicache vs a cold prefill.

A model big enough that prefill costs something on this CPU (Llama-shaped, dummy
weights: ``--layers`` 4, ``--hidden`` 512, 8 heads / 4 KV heads of 64), ``--prompts``
prompts of ``--prompt-tokens`` tokens in ``--groups`` groups sharing ``--shared``-token
prefixes. In one run, each engine a process of its own (vLLM's multiprocess engine):

* engine A (with the connector) generates every prompt: hicache stores their pages;
  before that, **miss**: ``--prompts`` other prompts of the same length that share nothing,
  each alone, its prefix cache emptied: a miss in hicache and a store of every page (what
  hicache costs a prompt it cannot help, against the baseline's cold prefill);
* **hicache**: engine B (with the connector, a new process) generates each prompt alone,
  its own prefix cache emptied before each one: all whole blocks but the last token's
  come from hicache's host tier;
* **baseline**: an engine without hicache, the same prompts, its prefix cache emptied
  before each one (a cold prefill), and
* **device hit**: right after each cold prompt, the same prompt again in that engine
  (vLLM's own prefix cache: the floor).

Outputs (greedy tokens and logprobs) of B must equal the baseline's. TTFT is vLLM's
``first_token_latency`` of each request (median over the prompts), after a warm-up
request in each engine.

    python benchmarks/bench_vllm.py [--prompts 6] [--prompt-tokens 2000] [--json]

Run it with the vLLM venv's python (``make test-vllm`` builds ``.venv-vllm``). With
``--json`` the last line is one JSON object with ``ttft_s``, ``ttft_baseline_s``,
``ttft_device_hit_s``, ``ttft_speedup`` (baseline / hicache), ``device_hit_ratio``
(hicache / device hit), ``ttft_miss_s``, ``miss_ratio`` (miss / baseline), ``hit_tokens``,
``prompt_tokens`` and ``outputs_identical``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "with_vllm" / "engine_run.py"
sys.path.insert(0, str(RUNNER.parent))

from engine_run import write_model  # noqa: E402


def make_prompts(n: int, length: int, groups: int, shared: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    words = lambda k: [rng.randrange(3, 4000) for _ in range(k)]  # noqa: E731
    prefixes = [words(shared) for _ in range(groups)]
    warmup = words(length)
    return [warmup] + [prefixes[i % groups] + words(length - shared) for i in range(n)]


def engine(work: Path, name: str, job: dict) -> dict:
    path = work / f"{name}.json"
    out = work / f"{name}.out.json"
    path.write_text(json.dumps(job))
    with open(work / f"{name}.log", "wb") as log:
        code = subprocess.call([sys.executable, str(RUNNER), str(path), str(out)], stdout=log,
                               stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"engine {name} failed ({code}): see {work / (name + '.log')}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--shared", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hicache-bench-vllm-"))
    model = str(write_model(work / "model", hidden=args.hidden, heads=8, kv_heads=4, head_dim=64,
                            layers=args.layers, intermediate=4 * args.hidden, vocab=4096, max_positions=4096))
    prompts = make_prompts(args.prompts, args.prompt_tokens, args.groups, args.shared)
    n = args.prompts
    prompts += make_prompts(n, args.prompt_tokens, groups=n, shared=0, seed=11)[1:]  # (each its own)
    misses = list(range(n + 1, 2 * n + 1))
    socket = work / "hicache.sock"
    config = work / "hicache.toml"
    config.write_text(f'[server]\nsocket = "{socket}"\n[host]\nbytes = {512 << 20}\n'
                      f'[disk]\nenabled = false\n[metrics]\nenabled = false\n')
    daemon = subprocess.Popen([str(Path(sys.executable).parent / "hicache"), "serve", "--config", str(config)],
                              stdout=open(work / "daemon.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise SystemExit(f"the daemon did not start: see {work / 'daemon.log'}")
            time.sleep(0.1)
        base = {"model_dir": model, "prompts": prompts, "max_tokens": 1, "logprobs": 3,
                "max_model_len": 4096, "engine": {"max_num_batched_tokens": 4096}}
        endpoint = f"ipc://{socket}"
        everything = list(range(1, n + 1))
        store = engine(work, "a", {**base, "endpoint": endpoint,
                                   "batches": [[0]] + [[i] for i in misses] + [everything],
                                   "reset_prefix_cache": True})
        hit = engine(work, "b", {**base, "endpoint": endpoint, "batches": [[0]] + [[i] for i in everything],
                                 "reset_prefix_cache": True})
        # Baseline engine: warm-up, then each prompt cold (cache emptied) and again (device hit).
        batches = [[0]] + [[i] for i in everything for _ in range(2)]
        cold_batches = [1 + 2 * k for k in range(n)]
        plain = engine(work, "baseline", {**base, "endpoint": None, "batches": batches,
                                          "reset_prefix_cache": cold_batches})
    finally:
        daemon.terminate()
        daemon.wait(30)

    def req(result, batch):
        return result["batches"][batch]["requests"][0]

    hicache = [req(hit, 1 + k) for k in range(n)]
    cold = [req(plain, b) for b in cold_batches]
    warm = [req(plain, b + 1) for b in cold_batches]
    missed = [req(store, 1 + k) for k in range(n)]
    assert all(r["num_cached_tokens"] == 0 for r in missed), "a miss prompt hit"
    identical = all(h["tokens"] == c["tokens"] and h["logprobs"] == c["logprobs"] for h, c in zip(hicache, cold))
    ttft = statistics.median(r["ttft_s"] for r in hicache)
    ttft_base = statistics.median(r["ttft_s"] for r in cold)
    ttft_dev = statistics.median(r["ttft_s"] for r in warm)
    ttft_miss = statistics.median(r["ttft_s"] for r in missed)
    figures = {
        "prompts": n,
        "prompt_tokens": args.prompt_tokens,
        "hit_tokens": statistics.median(r["num_cached_tokens"] for r in hicache),
        "device_hit_tokens": statistics.median(r["num_cached_tokens"] for r in warm),
        "ttft_s": round(ttft, 4),
        "ttft_baseline_s": round(ttft_base, 4),
        "ttft_device_hit_s": round(ttft_dev, 4),
        "ttft_speedup": round(ttft_base / ttft, 2),
        "device_hit_ratio": round(ttft / ttft_dev, 2),
        "ttft_miss_s": round(ttft_miss, 4),
        "miss_ratio": round(ttft_miss / ttft_base, 3),
        "outputs_identical": identical,
    }
    print(f"{'':24} {'TTFT (median)':>14} {'cached tokens':>14}")
    print(f"{'baseline (cold prefill)':24} {ttft_base * 1e3:>11.1f} ms {0:>14}")
    print(f"{'hicache (host hit)':24} {ttft * 1e3:>11.1f} ms {figures['hit_tokens']:>14}")
    print(f"{'vLLM device hit':24} {ttft_dev * 1e3:>11.1f} ms {figures['device_hit_tokens']:>14}")
    print(f"{'hicache miss (+ store)':24} {ttft_miss * 1e3:>11.1f} ms {0:>14}")
    print(f"speedup {figures['ttft_speedup']}x over a cold prefill; {figures['device_hit_ratio']}x the device hit; "
          f"outputs identical: {identical}; a miss costs {figures['miss_ratio']}x the baseline")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
