"""Time to first token with real vLLM engines (the CPU wheel): hicache vs a cold prefill.

A model big enough that prefill costs something on this CPU (Llama-shaped, random
weights from a fixed seed, whose outputs depend on every token's KV: ``--layers`` 4, ``--hidden`` 512, 8 heads / 4 KV heads of 64), ``--prompts``
prompts of ``--prompt-tokens`` tokens in ``--groups`` groups sharing ``--shared``-token
prefixes. Three engines, each a process of its own (vLLM's multiprocess engine), run at
once and take turns, one request at a time — so that whatever else the machine does
falls on both sides of every comparison alike (run one after another, a busy minute in
one engine's run and a quiet one in the other's moved the ratios by tens of percent):

* **miss**: engine B (with the connector) generates ``--prompts`` prompts that share
  nothing, each alone, its prefix cache emptied: a miss in hicache and a store of every
  page (what hicache costs a prompt it cannot help), each right before or after (the
  order alternates) the **baseline** engine (without hicache) does the same prompt cold;
* then engine A (the connector as a ``kv_producer``: it stores and never loads)
  generates each of the benchmark's prompts alone, its prefix cache emptied: hicache
  stores the pages of a cold prefill of each prompt, as the baseline computes them (a
  producer that loaded a shared prefix, or ran the prompts in one batch, would compute
  the rest in other chunks: KV equal but for the last bits, which the output comparison
  below would see);
* **hicache**: engine B (its own prefix cache emptied before each
  prompt) generates each prompt alone: all whole blocks but the last token's come from
  hicache's host tier; next to it the baseline engine runs the same prompt cold
  (**baseline**: its prefix cache emptied) and then again (**device hit**: vLLM's own
  prefix cache, the floor).

Outputs: B's greedy tokens and logprobs must equal, bit for bit, those of vLLM's own
device hit on the same cached tokens (``outputs_identical``): hicache loads the very bytes
the prefill computed. Against the cold prefill the greedy tokens must be equal
(``tokens_identical_to_cold``); its logprobs may differ in the last bits
(``max_logprob_diff_cold``), as the device hit's do — a hit computes the last block's
attention over cached KV in other tiles than a prefill of the whole prompt. TTFT is vLLM's
``first_token_latency`` of each request (median over the prompts), after a warm-up
request in each engine.

    python benchmarks/bench_vllm.py [--prompts 6] [--prompt-tokens 2000] [--json]

Run it with the vLLM venv's python (``make test-vllm`` builds ``.venv-vllm``). With
``--json`` the last line is one JSON object with ``ttft_s``, ``ttft_baseline_s``,
``ttft_device_hit_s``, ``ttft_speedup`` (baseline / hicache), ``device_hit_ratio``
(hicache / device hit), ``ttft_miss_s``, ``ttft_miss_baseline_s`` (the baseline's cold prefill of the same
prompts), ``miss_ratio`` (miss / that), ``hit_tokens``,
``prompt_tokens``, ``outputs_identical``, ``tokens_identical_to_cold`` and
``max_logprob_diff_cold``.
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


IDLE_S = 1.5  # after a batch, how long an engine's worker may spin (vLLM: 1 s after its last read)


class Engines:
    """Engine processes (``engine_run.py``), each gated batch by batch: :meth:`step`
    lets one run its next batch and waits for it, so that only one engine computes at a
    time. vLLM's worker busy-waits (``sched_yield``) for its next message for a second
    after each one it reads; on this machine's two cores that took a third or more of
    the next engine's prefill (a cold prefill next to an engine just done took 2x as
    long), so each step then waits for the engine to go idle."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen] = {}
        self.steps: dict[str, int] = {}

    def start(self, name: str, job: dict) -> None:
        gate = self.work / f"gate-{name}"
        gate.mkdir()
        (self.work / f"{name}.json").write_text(json.dumps({**job, "gate_dir": str(gate)}))
        with open(self.work / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, str(RUNNER), str(self.work / f"{name}.json"), str(self.work / f"{name}.out.json")],
                stdout=log, stderr=subprocess.STDOUT)
        self.steps[name] = 0

    def step(self, name: str) -> None:
        i = self.steps[name]
        gate = self.work / f"gate-{name}"
        (gate / f"go-{i}").write_text("")
        while not (gate / f"done-{i}").exists():
            if self.procs[name].poll() is not None:
                raise SystemExit(f"engine {name} failed: see {self.work / (name + '.log')}")
            time.sleep(0.005)
        self.steps[name] = i + 1
        time.sleep(IDLE_S)

    def results(self) -> dict[str, dict]:
        for name, proc in self.procs.items():
            if proc.wait(120) != 0:
                raise SystemExit(f"engine {name} failed ({proc.returncode}): see {self.work / (name + '.log')}")
        return {name: json.loads((self.work / f"{name}.out.json").read_text()) for name in self.procs}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


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
        cold_batches = [n + 1 + 2 * k for k in range(n)]  # the baseline's (each then again: a device hit)
        engines = Engines(work)
        try:
            # A (a producer): warm-up, then every prompt alone (stored). The baseline:
            # warm-up, the misses cold, then each prompt cold and again. B: warm-up, the
            # misses, then each prompt.
            engines.start("a", {**base, "endpoint": endpoint, "kv_role": "kv_producer",
                                "batches": [[0]] + [[i] for i in everything], "reset_prefix_cache": True})
            engines.start("baseline", {**base, "endpoint": None,
                                       "batches": [[0]] + [[i] for i in misses] + [[i] for i in everything for _ in
                                                                                   range(2)],
                                       "reset_prefix_cache": list(range(1, n + 1)) + cold_batches})
            engines.start("b", {**base, "endpoint": endpoint,
                                "batches": [[0]] + [[i] for i in misses] + [[i] for i in everything],
                                "reset_prefix_cache": True})
            for name in ("a", "baseline", "b"):
                engines.step(name)  # warm-ups (B's loads A's warm-up prompt from hicache)
            for k in range(n):
                for name in (("b", "baseline") if k % 2 == 0 else ("baseline", "b")):
                    engines.step(name)
            for k in range(n):
                engines.step("a")
            for k in range(n):
                turns = (["b"], ["baseline", "baseline"])
                for names in (turns if k % 2 == 0 else turns[::-1]):
                    for name in names:
                        engines.step(name)
            out = engines.results()
        finally:
            engines.stop()
        store, hit, plain = out["a"], out["b"], out["baseline"]
    finally:
        daemon.terminate()
        daemon.wait(30)

    def req(result, batch):
        return result["batches"][batch]["requests"][0]

    hicache = [req(hit, 1 + n + k) for k in range(n)]
    cold = [req(plain, b) for b in cold_batches]
    warm = [req(plain, b + 1) for b in cold_batches]
    missed = [req(hit, 1 + k) for k in range(n)]
    assert all(r["num_cached_tokens"] == 0 for r in (req(store, 1 + k) for k in range(n))), "the producer loaded"
    missed_cold = [req(plain, 1 + k) for k in range(n)]
    assert all(r["num_cached_tokens"] == 0 for r in missed), "a miss prompt hit"
    identical = all(h["tokens"] == w["tokens"] and h["logprobs"] == w["logprobs"] for h, w in zip(hicache, warm))
    tokens_as_cold = all(h["tokens"] == c["tokens"] for h, c in zip(hicache, cold))
    diff_cold = max(abs(a[1] - b[1]) for h, c in zip(hicache, cold) for x, y in zip(h["logprobs"], c["logprobs"])
                    for a, b in zip(x, y) if a[0] == b[0])
    ttft = statistics.median(r["ttft_s"] for r in hicache)
    ttft_base = statistics.median(r["ttft_s"] for r in cold)
    ttft_dev = statistics.median(r["ttft_s"] for r in warm)
    ttft_miss = statistics.median(r["ttft_s"] for r in missed)
    ttft_miss_base = statistics.median(r["ttft_s"] for r in missed_cold)
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
        "ttft_miss_baseline_s": round(ttft_miss_base, 4),
        "miss_ratio": round(ttft_miss / ttft_miss_base, 3),
        "outputs_identical": identical,
        "tokens_identical_to_cold": tokens_as_cold,
        "max_logprob_diff_cold": diff_cold,
    }
    print(f"{'':24} {'TTFT (median)':>14} {'cached tokens':>14}")
    print(f"{'baseline (cold prefill)':24} {ttft_base * 1e3:>11.1f} ms {0:>14}")
    print(f"{'hicache (host hit)':24} {ttft * 1e3:>11.1f} ms {figures['hit_tokens']:>14}")
    print(f"{'vLLM device hit':24} {ttft_dev * 1e3:>11.1f} ms {figures['device_hit_tokens']:>14}")
    print(f"{'hicache miss (+ store)':24} {ttft_miss * 1e3:>11.1f} ms {0:>14}")
    print(f"{'baseline, the same':24} {ttft_miss_base * 1e3:>11.1f} ms {0:>14}")
    print(f"speedup {figures['ttft_speedup']}x over a cold prefill; {figures['device_hit_ratio']}x the device hit; "
          f"outputs identical to the device hit's: {identical} (tokens as cold: {tokens_as_cold}, logprobs within "
          f"{diff_cold:.2g}); a miss costs {figures['miss_ratio']}x the baseline")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
