"""``hicache demo``: the reference engine on a multi-turn chat, through a real daemon.

Starts ``hicache serve`` in a temporary directory (small pools, so that pages move down
to host and disk while you watch; metrics on a free local port) unless ``--endpoint``
names a running daemon, then plays a few conversations on shared system prompts with
the reference engine (:mod:`hicache.engine.reference`) and reports the prefill tokens
the cache saved, by tier.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from hicache.client import CacheClient
from hicache.daemon.spawn import start_daemon
from hicache.engine.reference import ModelConfig, ReferenceEngine, TinyTransformer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_daemon(directory: Path, metrics_port: int) -> subprocess.Popen:
    return start_daemon(directory, (
        f'[server]\nsocket = "{directory / "hicache.sock"}"\n'
        '[host]\nratio = 1.0\n'
        f'[disk]\npath = "{directory / "lmdb"}"\ncapacity_bytes = {256 << 20}\n'
        f'[metrics]\naddress = "127.0.0.1"\nport = {metrics_port}\n'
    ), name="hicache demo")


def _progress(done: int, total: int, note: str) -> None:
    width = 30
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests  {note:<40}", end="", flush=True)


def run(endpoint: str | None, conversations: int, turns: int, seed: int) -> int:
    directory = None
    daemon = None
    metrics = ""
    if endpoint is None:
        directory = Path(tempfile.mkdtemp(prefix="hicache-demo-"))
        port = _free_port()
        daemon = _start_daemon(directory, port)
        endpoint = f"ipc://{directory / 'hicache.sock'}"
        metrics = f"http://127.0.0.1:{port}/metrics"
    print(f"hicache demo: daemon at {endpoint}" + (f", metrics at {metrics}" if metrics else ""))
    rng = np.random.default_rng(seed)
    config = ModelConfig(seed=seed)
    engine = ReferenceEngine(TinyTransformer(config), num_pages=24, client=CacheClient(endpoint))
    prompts = [rng.integers(0, config.vocab, 64).tolist() for _ in range(2)]
    chats = [list(prompts[i % 2]) for i in range(conversations)]
    total_requests = conversations * turns
    prompt_tokens = 0
    saved = {"device": 0, "host": 0, "disk": 0, "remote": 0}
    start = time.monotonic()
    try:
        done = 0
        for turn in range(turns):
            for i in range(conversations):
                chats[i] += rng.integers(0, config.vocab, 24).tolist()
                result = engine.generate(chats[i], 6)
                chats[i] += result.tokens
                prompt_tokens += len(chats[i]) - len(result.tokens)
                for tier, n in result.from_tier.items():
                    saved[tier] += n
                done += 1
                hit = ", ".join(f"{n} from {t}" for t, n in result.from_tier.items() if n) or "miss"
                _progress(done, total_requests, f"turn {turn + 1}, chat {i + 1}: {hit}")
        stats = engine.client.stats()
    finally:
        engine.close()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            shutil.rmtree(directory, ignore_errors=True)
    total_saved = sum(saved.values())
    print()
    print(f"{total_requests} requests, {prompt_tokens} prompt tokens in {time.monotonic() - start:.1f} s")
    print(f"tokens saved: {total_saved} ({total_saved / max(prompt_tokens, 1):.0%} of the prefill): "
          + ", ".join(f"{n} from {tier}" for tier, n in saved.items()))
    requests = stats.get("requests", {})
    print(f"daemon: {sum(requests.values())} requests served, "
          f"{sum(n for k, n in requests.items() if not k.endswith('/OK'))} errors")
    if metrics:
        print(f"(the metrics were at {metrics} while the demo ran; point Prometheus at a daemon's "
              "[metrics] port to keep them)")
    return 0
