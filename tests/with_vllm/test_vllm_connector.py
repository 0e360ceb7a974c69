"""Real vLLM engines (the CPU wheel) with the hicache connector and a real daemon.

Run by ``make test-vllm`` (in ``.venv-vllm``); skipped where vLLM is not installed.
Every engine is a process of its own (``engine_run.py``), started as vLLM is in
production: the multiprocess engines run the scheduler and the worker in separate
processes, so loads and locks taken on one side are used on the other. Engine starts
cost ~10-40 s each on 2 cores, so the suite keeps to a handful.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from daemon_util import DaemonProcess  # noqa: E402
from hicache.client import CacheClient  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_run.py"
BLOCK = 32
MAX_TOKENS = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prompts(seed: int = 1) -> list[list[int]]:
    """Five prompts: three share a 200-token prefix, one shares 96 of it, one is alone."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    prefix = words(200)
    return [prefix + words(57), prefix + words(90), prefix + words(31), prefix[:96] + words(77), words(140)]


def whole_blocks_but_last(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    sys.path.insert(0, str(HERE))
    from engine_run import write_model

    return str(write_model(tmp_path_factory.mktemp("model")))


class Daemon:
    """``hicache serve`` with a metrics port, a state directory that survives restarts."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.process = DaemonProcess(
            directory, server={"lease_s": 2.0}, host={"bytes": 64 << 20},
            disk={"path": str(directory / "lmdb"), "capacity_bytes": 256 << 20},
            metrics={"enabled": True, "port": self.port})
        self.endpoint = self.process.endpoint

    def start(self) -> "Daemon":
        self.process.start()
        return self

    def stop(self) -> None:
        assert self.process.stop() == 0, self.process.log.read_text()

    def metric(self, name: str, **labels: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}}") or (not labels and line.startswith(name + " ")):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no sample {name}{{{want}}}")

    def check(self) -> dict:
        client = CacheClient(self.endpoint, heartbeat=False)
        try:
            client.check()
            return client.stats()
        finally:
            client.close()


def job(tmp_path: Path, name: str, model: str, endpoint: str | None, batches, **extra) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"model_dir": model, "endpoint": endpoint, "prompts": prompts(), "batches": batches,
                                "max_tokens": MAX_TOKENS, "logprobs": 3, **extra}))
    return path


def start_engine(tmp_path: Path, name: str, job_path: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{name}.out.json"
    log = open(tmp_path / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, str(RUNNER), str(job_path), str(out)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def finish(proc: subprocess.Popen, out: Path, timeout_s: float = 600) -> dict:
    code = proc.wait(timeout_s)
    assert code == 0, (out.with_suffix("").with_suffix(".log").name, _tail(proc, out))
    return json.loads(out.read_text())


def _tail(proc, out: Path) -> str:
    log = out.parent / (out.name.replace(".out.json", ".log"))
    return log.read_text(errors="replace")[-4000:]


def run(tmp_path: Path, name: str, job_path: Path) -> dict:
    return finish(*start_engine(tmp_path, name, job_path))


def by_prompt(result: dict) -> dict[int, dict]:
    return {r["prompt"]: r for batch in result["batches"] for r in batch["requests"]}


def assert_same_outputs(result: dict, baseline: dict) -> None:
    want = by_prompt(baseline)
    for batch in result["batches"]:
        for r in batch["requests"]:
            assert r["tokens"] == want[r["prompt"]]["tokens"], r["prompt"]
            assert r["logprobs"] == want[r["prompt"]]["logprobs"], r["prompt"]


def with_token_changed(prompt: list[int], place: int) -> list[int]:
    changed = list(prompt)
    changed[place] = changed[place] % 997 + 3  # (another id in the prompts' range 3..999)
    return changed


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory) -> dict:
    """Every prompt, without hicache, in one engine (vLLM's own prefix cache emptied
    before each prompt: cold prefills); then prompt 0 with one token changed in its
    first block (prompt 5) and in its fourth (prompt 6), for
    :func:`test_the_outputs_compared_depend_on_the_kv_of_every_block`."""
    tmp = tmp_path_factory.mktemp("baseline")
    zero = prompts()[0]
    probes = prompts() + [with_token_changed(zero, 0), with_token_changed(zero, 3 * BLOCK + 5)]
    return run(tmp, "baseline", job(tmp, "baseline", model, None, [[i] for i in range(7)], multiprocessing=False,
                                    reset_prefix_cache=True, prompts=probes))


def test_the_outputs_compared_depend_on_the_kv_of_every_block(baseline):
    """The comparisons with the baseline can fail: one token changed early in the prompt
    (so that its KV, and every later position's, differs) changes the logprobs of what
    the model generates. (With vLLM's dummy weights it did not: see ``write_model``.)"""
    results = by_prompt(baseline)
    for probe in (5, 6):
        assert results[probe]["logprobs"][0] != results[0]["logprobs"][0], probe


def test_a_second_engine_hits_what_the_first_stored_then_disk_after_a_daemon_restart(tmp_path, model, baseline):
    daemon = Daemon(tmp_path / "d").start()
    try:
        # Engine A computes every prompt in one batch and stores their whole pages. (Its
        # own outputs are not compared: vLLM's outputs of a step with several requests
        # differ from a prompt run alone in the last bits of a logprob; the KV it stores
        # does not, so that the solo runs below equal the baseline bit for bit.)
        run(tmp_path, "a", job(tmp_path, "a", model, daemon.endpoint, [[0, 1, 2, 3, 4]]))
        host_before = daemon.metric("hicache_matched_tokens_total", tier="host")
        # Engine B, a new process with its own prefix cache empty: each prompt alone, so
        # every cached token comes from hicache.
        b = run(tmp_path, "b", job(tmp_path, "b", model, daemon.endpoint, [[i] for i in range(5)],
                                   reset_prefix_cache=True))
        assert_same_outputs(b, baseline)
        for i, r in by_prompt(b).items():
            assert r["num_cached_tokens"] == whole_blocks_but_last(prompts()[i]), (i, r["num_cached_tokens"])
        # vLLM's own figures say where the cached tokens came from: hicache's host tier
        assert b["cached_by_source"] == {"host": sum(whole_blocks_but_last(p) for p in prompts())}
        host_hits = daemon.metric("hicache_matched_tokens_total", tier="host") - host_before
        assert host_hits >= sum(whole_blocks_but_last(p) for p in prompts())
        assert daemon.check()["sessions"] == 0
        host = next(iter(daemon.check()["specs"].values()))["host"]
        assert host["cached_protected"] == 0 and host["cached_evictable"] > 0
        client = CacheClient(daemon.endpoint, heartbeat=False)
        client.flush()
        client.close()
    finally:
        daemon.stop()
    # The host tier is gone with the daemon; the disk tier is not.
    daemon = Daemon(tmp_path / "d")
    daemon.start()
    try:
        c = run(tmp_path, "c", job(tmp_path, "c", model, daemon.endpoint, [[i] for i in range(5)],
                                   multiprocessing=False, reset_prefix_cache=True))
        assert_same_outputs(c, baseline)
        for i, r in by_prompt(c).items():
            assert r["num_cached_tokens"] == whole_blocks_but_last(prompts()[i]), (i, r["num_cached_tokens"])
        assert daemon.metric("hicache_matched_tokens_total", tier="disk") > 0
        # the first prompt of a prefix from disk, the prompts after it sharing it from host
        by_source = c["cached_by_source"]
        assert set(by_source) == {"host", "disk"} and sum(by_source.values()) == sum(
            whole_blocks_but_last(p) for p in prompts()), by_source
        daemon.check()
    finally:
        daemon.stop()



def test_after_a_weight_update_and_a_cache_reset_nothing_of_the_old_weights_is_loaded(tmp_path, model):
    """A training loop changes the weights in place and resets vLLM's caches, the
    connector's included (``reset_prefix_cache(reset_connector=True)``): the next run of
    a prompt hicache holds computes it afresh (before, the connector took the reset for
    done and loaded the old weights' KV); the run after it, with only vLLM's own prefix
    cache emptied, loads what that run stored and generates the same, bit for bit."""
    daemon = Daemon(tmp_path / "d").start()
    try:
        out = run(tmp_path, "w", job(tmp_path, "w", model, daemon.endpoint, [[0], [0], [0]], multiprocessing=False,
                                     update_weights=[1], reset_prefix_cache=[2]))
        before, after, again = (batch["requests"][0] for batch in out["batches"])
        assert before["num_cached_tokens"] == 0
        assert after["num_cached_tokens"] == 0, "the old weights' KV was loaded after the reset"
        assert after["logprobs"] != before["logprobs"]  # (the update changes what the model computes)
        assert again["num_cached_tokens"] == whole_blocks_but_last(prompts()[0])
        assert (again["tokens"], again["logprobs"]) == (after["tokens"], after["logprobs"])
    finally:
        daemon.stop()

def test_a_tensor_parallel_engine_loads_each_ranks_own_kv(tmp_path, model):
    """TP 2: two worker processes, each holding half of the KV heads and caching them in
    a pool of its own. Prompts computed cold, then again with vLLM's prefix cache
    emptied: every whole block but the last token's comes from hicache — each rank's
    own shard (a rank that loaded the other's would change the logprobs) — and the
    outputs equal the cold ones. (Against the same engine's cold runs: TP 2 sums
    attention over the ranks in another order than TP 1, so its logprobs differ in the
    last bits from the TP 1 baseline.)"""
    daemon = Daemon(tmp_path / "d").start()
    try:
        result = run(tmp_path, "tp", job(
            tmp_path, "tp", model, daemon.endpoint, [[0], [4], [0], [4]], reset_prefix_cache=True,
            engine={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}))  # (vLLM binds a rank to a NUMA node: there is one)
        cold, hit = result["batches"][:2], result["batches"][2:]
        assert [b["requests"][0]["num_cached_tokens"] for b in cold] == [0, 0]
        assert [b["requests"][0]["num_cached_tokens"] for b in hit] == [
            whole_blocks_but_last(prompts()[0]), whole_blocks_but_last(prompts()[4])]
        assert_same_outputs({"batches": hit}, {"batches": cold})
        stats = daemon.check()
        assert stats["sessions"] == 0
        pages = sorted(spec["host"]["cached_evictable"] for spec in stats["specs"].values())
        stored = sum(len(prompts()[i]) // BLOCK for i in (0, 4))
        assert pages == [stored, stored]  # one spec per rank, each with every whole page
    finally:
        daemon.stop()


def test_preempted_requests_store_and_load_their_own_blocks(tmp_path, model, baseline):
    """An engine with too few blocks for its batch: vLLM preempts requests mid-decode,
    frees their blocks and, on resume, gives them others (hicache loads their prompt
    pages into those). What it stored must be each prompt's own KV: the same engine,
    its prefix cache emptied, then hits every prompt in hicache with outputs equal to
    cold prefills."""
    daemon = Daemon(tmp_path / "d").start()
    try:
        alone = [[i] for i in range(5)]
        result = run(tmp_path, "tight", job(
            tmp_path, "tight", model, daemon.endpoint, [[0, 1, 2, 3, 4]] + alone,
            max_tokens=[200] + [MAX_TOKENS] * 5, reset_prefix_cache=list(range(1, 6)), max_model_len=512,
            engine={"num_gpu_blocks_override": 20, "max_num_batched_tokens": 64}))
        assert result["preemptions"] > 0
        assert [len(r["tokens"]) for r in result["batches"][0]["requests"]] == [200] * 5
        assert_same_outputs({"batches": result["batches"][1:]}, baseline)
        for batch in result["batches"][1:]:
            for r in batch["requests"]:
                assert r["num_cached_tokens"] == whole_blocks_but_last(prompts()[r["prompt"]]), r
        stats = daemon.check()
        assert stats["sessions"] == 0
        for spec in stats["specs"].values():
            assert spec["host"]["cached_protected"] == 0
    finally:
        daemon.stop()


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"engine exited with {proc.returncode} before {path.name}"
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.1)


def test_an_engine_killed_mid_generation_leaves_the_other_correct_and_gives_everything_back(
        tmp_path, model, baseline):
    daemon = Daemon(tmp_path / "d").start()
    gates = {name: tmp_path / f"gate-{name}" for name in ("x", "y")}
    for gate in gates.values():
        gate.mkdir()
    try:
        x_proc, _ = start_engine(tmp_path, "x", job(
            tmp_path, "x", model, daemon.endpoint, [[0, 1, 2, 3, 4]], multiprocessing=False, repeat=50,
            reset_prefix_cache=True, gate_dir=str(gates["x"]), engine={"max_num_batched_tokens": 64}))
        y_proc, y_out = start_engine(tmp_path, "y", job(
            tmp_path, "y", model, daemon.endpoint, [[i] for i in range(5)], multiprocessing=False, repeat=2,
            reset_prefix_cache=True, gate_dir=str(gates["y"])))
        # X runs its first batch (and stores), then keeps generating: kill it mid-batch.
        (gates["x"] / "go-0").write_text("")
        _wait_file(gates["x"] / "done-0", x_proc)
        for step in range(1, 50):
            (gates["x"] / f"go-{step}").write_text("")
        time.sleep(1.0)  # (in its next batches: chunked prefill of 64 tokens a step, loads, stores)
        os.killpg(x_proc.pid, signal.SIGKILL)
        x_proc.wait(30)
        # Y generates all its batches, hitting what X stored, with correct outputs.
        for step in range(10):
            (gates["y"] / f"go-{step}").write_text("")
        y = finish(y_proc, y_out)
        assert_same_outputs(y, baseline)
        assert sum(r["num_cached_tokens"] for r in y["batches"][0]["requests"]) > 0
        # After X's lease everything it held is back: one engine fewer, nothing protected.
        deadline = time.monotonic() + 30
        while daemon.check()["sessions"] != 0:
            assert time.monotonic() < deadline, "the killed engine's sessions never ended"
            time.sleep(0.5)
        stats = daemon.check()
        for spec in stats["specs"].values():
            assert spec["host"]["cached_protected"] == 0 and spec["host"]["staging"] == 0
        assert daemon.metric("hicache_sessions_ended_total", reason="lease_expired") >= 1
    finally:
        daemon.stop()


def test_requests_complete_while_the_daemon_is_down_and_hit_again_when_it_returns(tmp_path, model, baseline):
    daemon = Daemon(tmp_path / "d").start()
    gate = tmp_path / "gate"
    gate.mkdir()
    # (one prompt a batch: a batch of several differs from the baseline in the last bits)
    proc, out = start_engine(tmp_path, "e", job(
        tmp_path, "e", model, daemon.endpoint, [[0], [3], [1], [4], [2]], multiprocessing=True,
        reset_prefix_cache=True, gate_dir=str(gate)))

    def batches(*steps: int) -> None:
        for step in steps:
            (gate / f"go-{step}").write_text("")
            _wait_file(gate / f"done-{step}", proc)

    try:
        batches(0, 1)  # up: computes and stores prompts 0 and 3
        daemon.stop()
        batches(2, 3)  # down: prompts 1 and 4 miss, but the requests complete
        daemon.start()
        time.sleep(3.0)  # (the engine's clients find the daemon back within a second or two)
        (gate / "go-4").write_text("")  # back: prompt 2 shares the prefix prompt 0 stored (on disk now)
        result = finish(proc, out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if daemon.process.proc is not None:
            daemon.stop()
    assert_same_outputs(result, baseline)
    down = {r["prompt"]: r["num_cached_tokens"] for batch in result["batches"][2:4] for r in batch["requests"]}
    assert down == {1: 0, 4: 0}
    back = result["batches"][4]["requests"][0]
    assert back["num_cached_tokens"] >= 192  # the shared 200-token prefix: six whole blocks


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_engines_over_curve_hit_their_own_tenant_only(tmp_path, model, baseline):
    """Two identities over CURVE ``tcp://`` (keys and tenant through the connector's
    extra config): X's engine stores every prompt; Y's engine gets no hicache hit on them
    (other tenant) and still the same outputs; a second engine of X hits them all."""
    from hicache.auth import read_public, write_keypair

    keys = {}
    (tmp_path / "keys").mkdir()
    for name in ("server", "x", "y"):
        public, secret = write_keypair(tmp_path / "keys" / name)
        keys[name] = {"public": str(public), "secret": str(secret), "z85": read_public(public).decode()}
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    identities = [{"name": "x", "public_keys": [keys["x"]["z85"]], "tenants": ["tx"], "admin": True},
                  {"name": "y", "public_keys": [keys["y"]["z85"]], "tenants": ["ty"]}]
    (tmp_path / "d").mkdir()
    daemon = DaemonProcess(
        tmp_path / "d", server={"lease_s": 2.0, "tcp": endpoint}, host={"bytes": 64 << 20}, disk={"enabled": False},
        metrics={"enabled": False},
        auth={"secret_key_file": keys["server"]["secret"], "default_identity": "", "identities": identities},
        probe={"endpoint": endpoint, "server_key": keys["server"]["public"], "key_file": keys["x"]["secret"]})
    daemon.start()

    def curve(who: str) -> dict:
        return {"extra_config": {"hicache.server_key": keys["server"]["public"], "hicache.key_file": keys[who]["secret"]}}

    try:
        # (X's batch of five is not compared: see the first test)
        run(tmp_path, "x", job(tmp_path, "x", model, endpoint, [[0, 1, 2, 3, 4]], **curve("x")))
        y = run(tmp_path, "y", job(tmp_path, "y", model, endpoint, [[i] for i in range(5)], multiprocessing=False,
                                   reset_prefix_cache=True, **curve("y")))
        assert_same_outputs(y, baseline)
        # Y hits only what Y itself stored, prompt by prompt: none of X's pages (prompt 0,
        # which X stored whole, is a full miss for Y).
        ps = prompts()
        for i, r in by_prompt(y).items():
            own = max((_shared(ps[i], ps[j]) for j in range(i)), default=0)
            assert r["num_cached_tokens"] == min(own // BLOCK * BLOCK, whole_blocks_but_last(ps[i])), (i, r)
        x2 = run(tmp_path, "x2", job(tmp_path, "x2", model, endpoint, [[i] for i in range(5)], multiprocessing=False,
                                     reset_prefix_cache=True, **curve("x")))
        assert_same_outputs(x2, baseline)
        for i, r in by_prompt(x2).items():
            assert r["num_cached_tokens"] == whole_blocks_but_last(prompts()[i]), (i, r["num_cached_tokens"])
        admin = CacheClient(endpoint, heartbeat=False, server_key=keys["server"]["public"],
                            key_file=keys["x"]["secret"])
        try:
            admin.check()
        finally:
            admin.close()
    finally:
        assert daemon.stop() == 0, daemon.log.read_text()
