"""Two nodes and a Mooncake Store: the remote tier end to end.

A real ``mooncake_master`` and a segment holder on loopback (TCP, ``P2PHANDSHAKE``), two
``hicache serve`` daemons on separate state directories standing for two nodes, the
reference engine on each. Every generation is checked against an engine with caching
disabled: logits bit-identical, whichever tier the prefix came from.
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

from daemon_util import DaemonProcess, scraped
from engine_util import same_generation
from hicache.client import CacheClient
from hicache.engine.reference import ModelConfig, ReferenceEngine, TinyTransformer
from hicache.storage.mooncake_local import free_port

CONFIG = ModelConfig(seed=5)


@pytest.fixture(scope="module")
def model():
    return TinyTransformer(CONFIG)




class Node:
    """One machine: a daemon (its own state directory and metrics port) and an engine."""

    def __init__(self, directory, mooncake_store, model) -> None:
        directory.mkdir()
        self.port = free_port()
        self.daemon = DaemonProcess(
            directory, host={"ratio": 2.0}, disk={"capacity_bytes": 64 << 20},
            metrics={"enabled": True, "address": "127.0.0.1", "port": self.port},
            remote={"enabled": True, "master": mooncake_store.master, "prefetch_policy": "wait_complete",
                    "retry_s": 0.2})
        self.model = model
        self.engine: ReferenceEngine | None = None

    def start(self) -> "Node":
        return self.launch().ready()

    def launch(self) -> "Node":
        self.daemon.launch()
        return self

    def ready(self) -> "Node":
        self.daemon.wait_ready()
        self.engine = ReferenceEngine(self.model, num_pages=64, client=CacheClient(
            self.daemon.endpoint, timeout_s=5.0, reconnect_interval_s=0.1))
        return self

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.daemon.proc is not None:
            assert self.daemon.stop() == 0

    def metric(self, name: str, **labels) -> float:
        return scraped(self.port, name, **labels)




def test_a_prefix_computed_on_one_node_is_served_on_another(tmp_path, mooncake_store, model):
    plain = ReferenceEngine(model, num_pages=200)
    a, b = (Node(tmp_path / name, mooncake_store, model).launch() for name in "ab")  # side by side
    a.ready()
    b.ready()
    rng = np.random.default_rng(0)
    try:
        def run(node, prompt):
            got = node.engine.generate(prompt, 6)
            same_generation(got, plain.generate(prompt, 6))
            return got

        shared = rng.integers(0, CONFIG.vocab, 130).tolist()
        first = run(a, shared)
        assert first.cached_tokens == 0
        a.engine.client.flush()  # (the write-through to the remote tier is done)
        assert a.metric("hicache_remote_pages_total", op="put", result="ok") >= 130 // CONFIG.page_size

        # Node B has never seen it: the whole-page prefix comes from the remote tier.
        got = run(b, shared)
        assert got.from_tier["remote"] == (len(shared) - 1) // CONFIG.page_size * CONFIG.page_size, got.from_tier
        assert b.metric("hicache_remote_lookups_total", result="hit") >= 1
        # ... and is B's own now (host, then device): no second remote read.
        again = run(b, shared)
        assert again.from_tier["remote"] == 0 and again.cached_tokens == got.cached_tokens

        # Node A restarts with its disk tier wiped: it still hits, from the remote tier.
        a.stop()
        shutil.rmtree(tmp_path / "a" / "lmdb")
        a.start()
        restarted = run(a, shared + [7, 8, 9])
        assert restarted.from_tier["remote"] > 0 and restarted.from_tier["disk"] == 0, restarted.from_tier

        # The master dies mid-traffic: both nodes keep serving from their own tiers.
        mooncake_store.kill_master()
        local = run(b, shared + [1, 2, 3])
        assert local.cached_tokens > 0 and local.from_tier["remote"] == 0
        fresh = rng.integers(0, CONFIG.vocab, 70).tolist()
        assert run(a, fresh).cached_tokens == 0  # a miss asks the dead master: a miss, not a hang
        a.engine.client.flush()
        assert run(a, fresh).cached_tokens > 0  # (its own tiers still work)
        assert a.metric("hicache_remote_up") == 0
        assert a.metric("hicache_remote_errors_total") >= 1
        assert "remote tier unreachable" in a.daemon.log.read_text()

        # The master returns: the daemons rejoin; what is written now is shared again.
        mooncake_store.start_master()
        mooncake_store.wait_segment()
        later = rng.integers(0, CONFIG.vocab, 100).tolist()
        # Until node A's writes get through again (its retry after retry_s, Mooncake's
        # re-mount): a bounded number of attempts, paced, never a wall-clock bound.
        for _ in range(100):
            run(a, later)
            a.engine.client.flush()
            if a.metric("hicache_remote_up") == 1 and b_probe(b, later, run):
                break
            time.sleep(0.2)  # (pacing: at least one retry_s between attempts)
            later = later + rng.integers(0, CONFIG.vocab, CONFIG.page_size).tolist()
        else:
            pytest.fail("the remote tier did not come back in 100 attempts")
        assert "remote tier reachable again" in a.daemon.log.read_text()
    finally:
        a.stop()
        b.stop()
        plain.close()


def b_probe(b, prompt, run) -> bool:
    """Did node B get ``prompt``'s prefix from the remote tier?"""
    return run(b, prompt).from_tier["remote"] > 0


def test_a_corrupt_remote_value_is_a_miss_never_wrong_kv(tmp_path, mooncake_store, model):
    from hicache.keys import ROOT_PARENT_KEY, chain_page_keys, namespace_id, pack_tokens
    from hicache.storage.mooncake_backend import object_name

    plain = ReferenceEngine(model, num_pages=200)
    a, b = (Node(tmp_path / name, mooncake_store, model).launch() for name in "ab")  # side by side
    a.ready()
    b.ready()
    raw = mooncake_store.client()
    try:
        prompt = np.random.default_rng(1).integers(0, CONFIG.vocab, 129).tolist()
        a.engine.generate(prompt, 2)
        a.engine.client.flush()
        # Flip one byte of the third page's object, as a faulty node would have stored it.
        ps = CONFIG.page_size
        ns = namespace_id(CONFIG.spec.fingerprint)
        keys = chain_page_keys(ns, ROOT_PARENT_KEY, pack_tokens(prompt[: 4 * ps]), ps)
        name = object_name(ns, keys[32:48])
        blob = bytearray(raw.get(name))
        assert blob, "node A's page is not in the store"
        blob[-5] ^= 0x40
        assert raw.upsert(name, bytes(blob)) == 0
        got = b.engine.generate(prompt, 6)
        same_generation(got, plain.generate(prompt, 6))
        assert got.from_tier["remote"] == 2 * ps, got.from_tier  # the pages before the bad one
        assert b.metric("hicache_remote_pages_total", op="get", result="corrupt") == 1
    finally:
        raw.close()
        a.stop()
        b.stop()
        plain.close()


def test_a_purge_on_any_node_removes_the_pages_every_node_put(tmp_path, mooncake_store, model):
    """Node A computes prompts (written through to the store). Node B, which never saw
    them, purges one user's (their extra key): the store holds none of its pages. Node
    A restarts with its pages' records gone but its tenant log kept, and no engine
    registered yet: a purge of the whole tenant — a namespace no tier of A holds, of a
    spec no tier manager serves, only the log names — removes the other user's pages
    from the store too. With the store's master down, a purge says
    what it could not do (exit 2), and does it once the master is back."""
    from daemon_util import HICACHE, run_hicache
    from hicache.keys import namespace_id, page_keys
    from hicache.storage.mooncake_backend import object_name

    a, b = (Node(tmp_path / name, mooncake_store, model).launch() for name in "ab")  # side by side
    a.ready()
    b.ready()
    raw = mooncake_store.client()
    rng = np.random.default_rng(3)
    ps = CONFIG.page_size
    prompts = {user: rng.integers(0, CONFIG.vocab, 4 * ps + 1).tolist() for user in ("user-1", "user-2")}

    def stored(user: str) -> list[int]:
        ns = namespace_id(CONFIG.spec.fingerprint, user)
        return [raw.is_exist(object_name(ns, key)) for key in page_keys(ns, prompts[user], ps)]

    def purge(node: Node, *extra: str) -> "subprocess.CompletedProcess":
        (done,) = run_hicache([HICACHE, "purge", "--endpoint", node.daemon.endpoint, "--tenant", "default",
                               "--wait", "0.1", *extra])
        return done

    try:
        for user, prompt in prompts.items():
            a.engine.generate(prompt, 2, extra_key=user)
        a.engine.client.flush()
        assert stored("user-1") == stored("user-2") == [1] * 4

        done = purge(b, "--extra-key", "user-1")
        assert done.returncode == 0 and "0 namespaces" in done.stdout and "4 from the remote store" in done.stdout, (
            done.stdout, done.stderr)
        assert stored("user-1") == [0] * 4 and stored("user-2") == [1] * 4
        assert b.metric("hicache_purged_pages_total", tier="remote") == 4

        a.stop()
        for path in (tmp_path / "a" / "lmdb").iterdir():  # (the records go; the tenant log stays)
            if path.name != "tenants":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        a.launch()
        a.daemon.wait_ready()
        done = purge(a)  # (no engine registered yet: no tier manager, the store asked off the owner thread)
        assert done.returncode == 0 and "4 from the remote store" in done.stdout, (done.stdout, done.stderr)
        assert stored("user-2") == [0] * 4
        assert a.metric("hicache_purged_pages_total", tier="remote") == 4
        a.ready()

        mooncake_store.kill_master()
        done = purge(a, "--extra-key", "user-2")
        assert done.returncode == 2 and "1 namespaces not purged from the remote store" in done.stdout, (
            done.stdout, done.stderr)
        mooncake_store.start_master()
        mooncake_store.wait_segment()
        for _ in range(100):  # (until node A's store client is back: paced attempts, no wall-clock bound)
            done = purge(a, "--extra-key", "user-2")
            if done.returncode == 0:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the purge never reached the store again: {done.stdout}")
        assert "0 from the remote store" in done.stdout, done.stdout
    finally:
        raw.close()
        a.stop()
        b.stop()
